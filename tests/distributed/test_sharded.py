"""Sharded gradients and AdamW state (`parallel.shard: optimizer`) against unsharded training on gloo ranks:
20 steps, losses, gradient norms and parameters within 1e-5 relative (fp32); data parallel, expert parallel,
Pro-Prophet replicas; resume across shard sizes."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from moebal.config import from_dict
from moebal.distributed.testing import run_ranks
from tests.distributed.shard_parity import (
    RESUME_STEPS,
    check_parity,
    checkpoint_state,
    clip_probe,
    leg,
    pair,
    rel,
    shard_cfg,
    train_run,
)


@pytest.mark.parametrize("world, ep", [(2, 1), (4, 2)])
def test_sharded_optimizer_matches_unsharded_for_10_steps(tmp_path, world, ep):
    check_parity(run_ranks(pair, world, str(tmp_path), ep, "static", "optimizer", timeout_s=600), "optimizer")


def test_sharded_optimizer_with_prophet_replicas_matches_unsharded(tmp_path):
    out = run_ranks(pair, 2, str(tmp_path), 2, "prophet", "optimizer", timeout_s=600)
    assert any(sum(r["replicas"]) > 0 for r in out[0]["optimizer"])  # Trans and Agg ran
    check_parity(out, "optimizer")


def test_sharded_optimizer_with_recompute_matches_unsharded(tmp_path):
    """`train.recompute: full` under the sharded optimizer (a layer's gradients arrive in its replayed forward's
    backward, where the backward hooks send the buckets) with Pro-Prophet replicas and block overlap: 6 steps on
    4 ranks (ep 2 x dp 2: dense state over 4 ranks, expert state over 2) within 1e-5 of unsharded with the same
    settings."""
    more = {"recompute": "full", "sections": {"scheduler": {"block_overlap": True}}}
    out = run_ranks(pair, 4, str(tmp_path), 2, "prophet", "optimizer", 6, more, timeout_s=900)
    assert any(sum(r["replicas"]) > 0 for r in out[0]["optimizer"])  # Trans and Agg ran
    check_parity(out, "optimizer", steps=6)


# ---- checkpoints: resume across shard sizes ------------------------------------------------------------------


def test_resume_across_shard_sizes_1_2_4_with_expert_parallelism(tmp_path):
    """One process for 2 steps, then 2 ranks (ep 2: dense state in 2 shards), then 4 ranks (ep 2: dense state in 4
    shards, expert state in 2), against one uninterrupted process: losses, weights and AdamW moments."""
    whole = run_ranks(leg, 1, str(tmp_path / "whole"), "none", None, False, None, timeout_s=600)[0]
    run = str(tmp_path / "resumed")
    run_ranks(leg, 1, run, "none", None, False, 2, timeout_s=600)
    run_ranks(leg, 2, run, "optimizer", 2, True, 4, timeout_s=600)
    resumed = run_ranks(leg, 4, run, "optimizer", 2, True, None, timeout_s=600)[0]
    assert [r["step"] for r in resumed] == list(range(1, RESUME_STEPS + 1))
    for a, b in zip(whole, resumed):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
    ref, got = (checkpoint_state(Path(d) / f"ckpt-{RESUME_STEPS:07d}") for d in (tmp_path / "whole", run))
    assert ref.keys() == got.keys() and any(k.endswith(":exp_avg") for k in ref)
    worst = max(rel(got[k], ref[k]) for k in ref if ref[k].norm() > 0)
    assert worst < 1e-5, worst
    manifest = json.loads((Path(run) / f"ckpt-{RESUME_STEPS:07d}" / "manifest.json").read_text())
    writers = {e["file"] for k, e in manifest["tensors"].items() if ":" in k}
    assert len(writers) == 4, writers  # the AdamW state was written by its owners, every rank a part


# ---- the optimizer alone: many small buckets, gradients, checkpoint state across bucket and shard sizes --------

def _direct(rank: int, world: int, root: str) -> dict[str, float]:
    """ShardedAdamW with 64-element buckets (every parameter cut over several buckets and owners) against AdamW
    on all-reduced gradients, 5 steps on ep 2 (dense state over 4 ranks, experts over 2); then its logical state
    written (`logical_state`) and read back into one with other buckets (`read_logical_state`). After the first
    backward pass: the send buffers still held once the collectives report completion (`_sends_released`)."""
    import copy

    import torch.distributed as dist

    from moebal.distributed.expert_parallel import ExpertParallel, is_expert_param
    from moebal.distributed.groups import ParallelDims
    from moebal.distributed.sharded import ShardedAdamW
    from moebal.models import build_model
    from moebal.train.checkpoint import Checkpointer, load_checkpoint, read_checkpoint
    from moebal.train.optim import build_optimizer

    cfg = shard_cfg("optimizer", 2)
    dims = ParallelDims(world_size=world, rank=rank, ep=2).init()
    torch.manual_seed(0)
    ref = build_model(cfg)
    model = copy.deepcopy(ref)
    ep_ref, ep = ExpertParallel(ref, dims), ExpertParallel(model, dims, sync_gradients=False)
    ref_opt, opt = build_optimizer(ref, cfg.train), ShardedAdamW(model, cfg.train, dims, bucket_elems=64)
    assert max(len(f.buckets) for f in opt.flats) > 4
    worst = {"grad": 0.0, "param": 0.0}
    for step in range(5):
        ids = torch.randint(0, 256, (2 * world, 17), generator=torch.Generator().manual_seed(step))
        x, y = ids[2 * rank:2 * rank + 2, :-1], ids[2 * rank:2 * rank + 2, 1:]
        for m, e in ((ref, ep_ref), (model, ep)):
            if m is model:
                opt.begin()
            out = m(x, y)
            (out.loss + out.aux_loss).backward()
            e.sync_gradients()
        if step == 0:
            worst["held"] = float(_sends_released(opt))
        opt.reduce()
        # every owned part against the same slice of the reference's averaged gradient
        for fl in opt.flats:
            ref_of = dict(zip(map(id, model.parameters()), ref.parameters()))
            full = torch.cat([ref_of[id(p)].grad.reshape(-1) for p in fl.params])
            full = torch.cat([full, full.new_zeros(fl.buf.numel() - full.numel())])
            for k, leaf in zip(fl.buckets, fl.leaves):
                b = opt.buckets[k]
                want = full[b.start + fl.index * b.part:b.start + (fl.index + 1) * b.part]
                worst["grad"] = max(worst["grad"], rel(leaf.grad, want) if want.norm() > 0 else 0.0)
        norm = opt.clip_grad_norm(float("inf"))
        sq = sum(float(p.grad.double().square().sum()) for p in ref.parameters() if not is_expert_param(p))
        sq_e = torch.tensor(sum(float(p.grad.double().square().sum()) for p in ref.parameters() if is_expert_param(p)))
        dist.all_reduce(sq_e, group=dims.group("ep"))
        worst["norm"] = abs(float(norm) - (sq + float(sq_e)) ** 0.5) / float(norm)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad()
        worst["param"] = max(worst["param"], max(rel(p, q) for p, q in zip(model.parameters(), ref.parameters())))
    # checkpoints: the sharded writer's logical state equals the reference optimizer's
    ck = Checkpointer(root, rank=rank, ranks=range(world), write_dense=dims.index("dp_ep") == 0,
                      write_experts=dims.index("dp") == 0, session="direct")
    ck.save(5, model, opt, global_state={"data": {}, "tokens": 0, "train_seconds": 0.0}, rank_state={},
            config_yaml="")
    ck_ref = Checkpointer(Path(root) / "ref", rank=rank, ranks=range(world), write_dense=dims.index("dp_ep") == 0,
                          write_experts=dims.index("dp") == 0, session="direct")
    ck_ref.save(5, ref, ref_opt, global_state={"data": {}, "tokens": 0, "train_seconds": 0.0}, rank_state={},
                config_yaml="")
    dist.barrier()
    a, b = checkpoint_state(Path(root) / "ckpt-0000005"), checkpoint_state(Path(root) / "ref" / "ckpt-0000005")
    assert a.keys() == b.keys()
    worst["ckpt"] = max(rel(a[k], b[k]) for k in a if b[k].norm() > 0)
    # read back into other buckets: each part holds the reference optimizer's moments of its slice
    other_model = build_model(cfg)  # its weights come from the checkpoint
    ExpertParallel(other_model, dims, sync_gradients=False)
    other = ShardedAdamW(other_model, cfg.train, dims, bucket_elems=200)
    with read_checkpoint(Path(root) / "ckpt-0000005") as reader:
        load_checkpoint(reader, other_model, other).apply()
    ref_by_name = dict(ref.named_parameters())
    name_of = {id(p): n for n, p in other_model.named_parameters()}
    worst["reload"] = 0.0
    for fl in other.flats:
        for key in ("exp_avg", "exp_avg_sq"):
            full = torch.cat([ref_opt.state[ref_by_name[name_of[id(p)]]][key].reshape(-1) for p in fl.params])
            full = torch.cat([full, full.new_zeros(fl.buf.numel() - full.numel())])
            for k, leaf in zip(fl.buckets, fl.leaves):
                b = other.buckets[k]
                want = full[b.start + fl.index * b.part:b.start + (fl.index + 1) * b.part]
                st = other.inner.state[leaf]
                assert float(st["step"]) == 5.0
                worst["reload"] = max(worst["reload"], rel(st[key], want) if want.norm() > 0 else 0.0)
    return worst


def _sends_released(opt: Any, timeout_s: float = 20.0) -> int:
    """After a backward pass: every dense bucket went out during it, and its collective reports completion
    without a wait (polled), after which no send buffer is held (gloo's own reduce-scatter never reported
    completion: its send buffers and gloo's clones of them stayed until `reduce`). The bytes still held."""
    assert opt.issued == sum(not b.late for b in opt.buckets) > 0
    deadline = time.monotonic() + timeout_s
    held = opt.release_completed()
    while held and time.monotonic() < deadline:
        time.sleep(0.01)
        held = opt.release_completed()
    return int(held)


def test_sharded_adamw_small_buckets_gradients_norm_and_state_roundtrip(tmp_path):
    for worst in run_ranks(_direct, 4, str(tmp_path), timeout_s=600):
        assert worst.pop("held") == 0  # send buffers released during the backward pass, no wait
        assert all(v < 1e-5 for v in worst.values()), worst


def _skips(rank: int, world: int, fused: bool) -> dict[str, Any]:
    """`ShardedAdamW(skips=True)` over 2 ranks (buckets of 40 elements: parameters cut between owners) against
    torch's AdamW on the averaged gradients, None where no rank has one. Step 2: `c` has no gradient on any rank,
    `b` only on rank 0 (rank 1 sends zeros); step 3: `b` on neither. `fused` False: the single-tensor arithmetic
    (a foreach optimizer's path), against torch's own."""
    from torch import nn

    from moebal.config import TrainConfig
    from moebal.distributed.groups import ParallelDims
    from moebal.distributed.sharded import ShardedAdamW

    dims = ParallelDims(world_size=world, rank=rank, ep=1).init()
    t = TrainConfig(lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(6, 5), "b": nn.Linear(5, 4), "c": nn.Linear(4, 3)})
    ref = nn.ModuleDict({k: nn.Linear(m.in_features, m.out_features) for k, m in model.items()})
    ref.load_state_dict(model.state_dict())
    opt = ShardedAdamW(model, t, dims, bucket_elems=40, skips=True)
    opt.inner.defaults["fused"] = fused
    decay = [p for n, p in ref.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in ref.named_parameters() if p.dim() < 2]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=1e-2, betas=(t.beta1, t.beta2), eps=1e-8, fused=fused or None,
                                foreach=None if fused else False)
    uses = {1: {0: "abc", 1: "abc"}, 2: {0: "ab", 1: "a"}, 3: {0: "a", 1: "ac"}, 4: {0: "abc", 1: "abc"}}
    worst = 0.0
    for step, by_rank in uses.items():
        opt.begin()
        grads: dict[str, list[torch.Tensor]] = {}
        for r, names in by_rank.items():
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + r))
            for m in (model, ref):
                h, loss = m["a"](x), 0.0
                if "b" in names:
                    loss = loss + m["b"](h).square().sum()
                if "c" in names:
                    loss = loss + m["c"](h[:, :4]).sum()
                if m is model and r == rank:
                    (loss + h.sum()).backward()
                elif m is ref:
                    ref.zero_grad(set_to_none=True)
                    (loss + h.sum()).backward()
                    for n, p in ref.named_parameters():
                        if p.grad is not None:
                            grads.setdefault(n, []).append(p.grad.clone())
        for n, p in ref.named_parameters():  # the mean over the ranks, a missing gradient as zeros; None if none
            p.grad = torch.stack(grads[n]).sum(0) / world if n in grads else None
        opt.reduce()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        worst = max(worst, max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters())))
    steps = {n: int(ref_opt.state[p]["step"]) for n, p in ref.named_parameters()}
    mine = {n: opt._agreed_steps()[f][i] for n, p in model.named_parameters() for f, i in [opt._of_param[id(p)]]}
    return {"worst": worst, "steps": steps, "mine": mine}


@pytest.mark.parametrize("fused", [True, False])
def test_sharded_adamw_skips_a_parameter_no_rank_has_a_gradient_of(fused):
    out = run_ranks(_skips, 2, fused)
    for r in out:
        assert r["steps"] == r["mine"] == {"a.weight": 4, "a.bias": 4, "b.weight": 3, "b.bias": 3, "c.weight": 3,
                                           "c.bias": 3}
        # the fused kernel is torch's own, and the single-tensor arithmetic is torch's single-tensor AdamW op for
        # op: the same bits either way (a misplaced eps moves a weight by about 1e-6 here)
        assert r["worst"] == 0.0, r["worst"]


def test_single_tensor_adamw_adds_eps_after_the_bias_correction_as_torch():
    """`_adamw` against torch's single-tensor AdamW with gradients of about 1e-6, where sqrt(v_hat) is near eps:
    eps added before dividing by sqrt(1 - beta2^t) instead of after moves the weights by about 1e-2."""
    from moebal.distributed.sharded import _adamw

    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(200, generator=g)
    ref = p0.clone().requires_grad_(True)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False)
    p, m, v = p0.clone(), torch.zeros(200), torch.zeros(200)
    for step in range(1, 5):
        grad = torch.randn(200, generator=g) * 1e-6
        ref.grad = grad.clone()
        ref_opt.step()
        _adamw(p, grad, m, v, 1e-2, 0.1, 0.9, 0.999, 1e-8, step)
    torch.testing.assert_close(p, ref.detach(), rtol=0, atol=1e-6)


def _clip_below(rank: int, world: int) -> dict[str, Any]:
    """`ShardedAdamW.clip_grad_norm` on 2 ranks (data parallel, parameters cut over both owners): a max_norm above
    the gradient norm keeps every owned gradient part as it was, bit for bit; one below scales them to it."""
    from torch import nn

    from moebal.config import TrainConfig
    from moebal.distributed.groups import ParallelDims
    from moebal.distributed.sharded import ShardedAdamW

    torch.set_num_threads(1)
    dims = ParallelDims(world_size=world, rank=rank, ep=1).init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4))
    opt = ShardedAdamW(model, TrainConfig(lr=1e-2), dims, bucket_elems=16)
    opt.begin()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    opt.reduce()

    def parts() -> list[torch.Tensor]:
        return [leaf.grad.clone() for fl in opt.flats for leaf in fl.leaves if leaf.grad is not None]

    out = clip_probe(opt, parts)
    opt.close()
    return out



def test_sharded_clip_with_the_norm_below_max_norm_changes_no_gradient():
    """torch's clip_grad_norm_ rule: the coefficient max_norm / norm is clamped at 1 (never scales gradients up)."""
    for r in run_ranks(_clip_below, 2):
        assert 0 < r["norm"] < r["above"], r
        assert r["kept"], r
        assert math.isclose(r["scaled"], r["norm"] / 4, rel_tol=1e-5), r


def test_native_reduce_scatter_only_where_nccl_serves_the_device():
    from moebal.distributed.sharded import native_reduce_scatter

    assert native_reduce_scatter("cpu:gloo,cuda:nccl", "cuda")  # moebal's groups on CUDA (groups.backend_for)
    assert not native_reduce_scatter("cpu:gloo,cuda:nccl", "cpu")
    assert not native_reduce_scatter("gloo", "cpu") and native_reduce_scatter("nccl", "cuda")


BF16_STEPS = 6


def _bf16_weights(rank: int, world: int, root: str) -> dict[str, Any]:
    """ep 1 on 2 ranks under bf16 autocast: fp32 weights, then bf16 weights (`parallel.param_dtype`, fp32 masters),
    uninterrupted and resumed from the checkpoint of step 2."""
    def cfg(param_dtype: str) -> Any:
        return shard_cfg("optimizer", 1, steps=BF16_STEPS, precision="bf16", ckpt_every=2,
                         parallel={"param_dtype": param_dtype})

    fp32 = train_run(cfg("fp32"), Path(root) / "fp32")
    bf16 = train_run(cfg("bf16"), Path(root) / "bf16")
    train_run(cfg("bf16"), Path(root) / "resumed", stop=2)
    resumed = train_run(cfg("bf16"), Path(root) / "resumed", resume=True)
    # plain data only crosses the result queue (a tensor's shared storage can outlive its rank's process)
    params = {n: (str(t.dtype), t.float().tolist()) for n, t in bf16["params"].items()} if rank == 0 else {}
    return {"fp32": fp32["rows"], "bf16": bf16["rows"], "resumed": resumed["rows"],
            "compute": (fp32["compute"], bf16["compute"]), "params": params}


def test_bf16_weights_with_fp32_masters_under_the_sharded_optimizer(tmp_path):
    """`parallel.param_dtype: bf16` under `shard: optimizer`: every rank keeps the replicated weights in bf16 and
    only its shard of them in fp32 (AdamW updates the fp32 shard; the bf16 copies are gathered from it). 6 steps
    on 2 ranks: losses finite and within 2 % of the fp32-weight run under the same autocast; checkpoints hold the
    fp32 masters (not the rounded copies: some weight differs from its bf16 rounding), and the final copies are
    the masters rounded; a run resumed from step 2 gives the uninterrupted run's losses bit for bit (masters and
    moments restored exactly)."""
    out = run_ranks(_bf16_weights, 2, str(tmp_path), timeout_s=900)[0]
    assert out["compute"] == (["torch.float32"], ["torch.bfloat16"])
    for a, b in zip(out["fp32"], out["bf16"], strict=True):
        assert math.isfinite(b["loss"]) and math.isfinite(b["grad_norm"])
        assert math.isclose(a["loss"], b["loss"], rel_tol=0.02), (a["step"], a["loss"], b["loss"])
    assert out["fp32"] != out["bf16"]
    assert [(r["step"], r["loss"]) for r in out["resumed"]] == [(r["step"], r["loss"]) for r in out["bf16"]]
    saved = checkpoint_state(tmp_path / "bf16" / f"ckpt-{BF16_STEPS:07d}")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert saved[q].dtype == torch.float32 and out["params"][q][0] == "torch.bfloat16"
    assert not torch.equal(saved[q], saved[q].to(torch.bfloat16).float())  # the masters, not the copies
    for name, (dtype, values) in out["params"].items():
        if dtype == "torch.bfloat16":  # bf16 values, exact in float
            assert torch.equal(saved[name].to(torch.bfloat16), torch.tensor(values).to(torch.bfloat16)), name


def _auto(rank: int, world: int, root: str) -> dict[str, Any]:
    """`parallel.shard: auto` (the default) in a library caller's run, on devices whose memory the plan says
    holds `optimizer` and not `none`; then the same run naming `optimizer`."""
    import dataclasses

    import moebal.train.memory as train_memory
    from moebal.config import load
    from moebal.planner.memory import DeviceMemory, layout_from_config, plan_memory

    cfg = shard_cfg("auto", 1, steps=3)

    def device(capacity: float, name: str = "d") -> DeviceMemory:
        return DeviceMemory(name=name, capacity_bytes=capacity, runtime_bytes=0.0, slack=0.0)

    def peak(shard: str) -> float:
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, shard=shard))
        return plan_memory(c, layout_from_config(c, world, precision="fp32"), device(1e15)).peak_bytes

    capacity = (peak("none") + peak("optimizer")) / 2
    train_memory._device_memory = lambda *_: device(capacity, "small")  # type: ignore[assignment]  # this rank only
    auto = train_run(cfg, Path(root) / "auto")
    named = train_run(shard_cfg("optimizer", 1, steps=3), Path(root) / "named")
    return {"auto": auto["rows"], "named": named["rows"], "optimizer": auto["optimizer"],
            "saved": load(Path(root) / "auto" / "config.yaml").parallel.shard}


def test_shard_auto_is_settled_by_a_library_callers_entry_points(tmp_path):
    """The default `parallel.shard: auto` reaching `setup_parallel` and the trainer (no `moebal train` to settle
    it): both settle it alike from the memory plan, here to `optimizer` on devices too small for `none`; the run
    is the sharded optimizer's, config.yaml keeps the choice, and the losses equal a run that named it."""
    out = run_ranks(_auto, 2, str(tmp_path), timeout_s=600)[0]
    assert out["optimizer"] == "ShardedAdamW" and out["saved"] == "optimizer"
    assert [(r["step"], r["loss"]) for r in out["auto"]] == [(r["step"], r["loss"]) for r in out["named"]]
    assert len(out["auto"]) == 3


def test_what_is_not_built_is_refused_with_the_fix():
    from moebal.errors import ConfigError

    # early exit in a pipeline: each parameter's own step count (tests/distributed/test_pipeline_sharded_schemes.py)
    assert from_dict({"parallel": {"pp": 2, "shard": "optimizer"}, "model": {"n_layers": 2},
                      "dynamism": {"scheme": "early_exit"}}).dynamism.scheme == "early_exit"
    assert from_dict({"parallel": {"pp": 2, "shard": "optimizer"}, "model": {"n_layers": 2}}).parallel.pp == 2
    assert shard_cfg("optimizer", 2).parallel.shard == "optimizer"
    # bf16 weights in a pipeline: built, with pruning too (its masks reach the fp32 gradient sums and masters,
    # tests/distributed/test_pipeline_sharded.py)
    assert shard_cfg("optimizer", 1, precision="bf16", parallel={"pp": 2, "param_dtype": "bf16"},
                     sections={"model": {"n_layers": 2}}).parallel.param_dtype == "bf16"
    pruned = shard_cfg("optimizer", 1, precision="bf16", parallel={"pp": 2, "param_dtype": "bf16"},
                       sections={"model": {"n_layers": 2}, "dynamism": {"scheme": "pruning"}})
    assert pruned.dynamism.scheme == "pruning"
    with pytest.raises(ConfigError, match="mixed-precision policy: set parallel.shard=full or optimizer"):
        shard_cfg("none", 1, parallel={"pp": 2, "reduce_dtype": "bf16"}, sections={"model": {"n_layers": 2}})


def _bf16_experts(rank: int, world: int, root: str, shard: str) -> dict[str, Any]:
    """ep 2 x dp 2 under bf16 autocast with Pro-Prophet replicas: fp32 weights, then bf16 weights
    (`parallel.param_dtype`, fp32 masters) for the dense and the expert-parallel parameters, uninterrupted and
    resumed from the checkpoint of step 2."""
    def cfg(param_dtype: str) -> Any:
        return shard_cfg(shard, 2, "broadcast_topk", steps=BF16_STEPS, precision="bf16", ckpt_every=2,
                         parallel={"param_dtype": param_dtype})

    fp32 = train_run(cfg("fp32"), Path(root) / "fp32")
    bf16 = train_run(cfg("bf16"), Path(root) / "bf16")
    train_run(cfg("bf16"), Path(root) / "resumed", stop=2)
    resumed = train_run(cfg("bf16"), Path(root) / "resumed", resume=True)
    w1 = bf16["params"]["model.layers.0.block_sparse_moe.experts.w1"]
    # plain data only crosses the result queue (a tensor's shared storage can outlive its rank's process)
    return {"fp32": fp32["rows"], "bf16": bf16["rows"], "resumed": resumed["rows"], "w1_dtype": str(w1.dtype),
            "w1": w1.float().tolist(), "at_rest": bf16["at_rest"]}


@pytest.mark.parametrize("shard", ["optimizer", "full"])
def test_bf16_expert_weights_with_fp32_masters(tmp_path, shard):
    """`parallel.param_dtype: bf16` with expert parallelism over 2 ranks per expert shard (ep 2 x dp 2): the
    expert-parallel weights are bf16 compute copies too, their fp32 masters the parts (under `full` all-gathered
    at rest from them, rounded). 6 steps with replicas (Trans and Agg in bf16): losses within 2 % of the
    fp32-weight run under the same autocast; the checkpoint holds the experts' fp32 masters and every final
    copy is its master rounded; a resume from step 2 gives the uninterrupted losses bit for bit."""

    out = run_ranks(_bf16_experts, 4, str(tmp_path), shard, timeout_s=900)
    for a, b in zip(out[0]["fp32"], out[0]["bf16"], strict=True):
        assert math.isfinite(b["loss"]) and math.isclose(a["loss"], b["loss"], rel_tol=0.02), (a, b)
    assert [(r["step"], r["loss"]) for r in out[0]["resumed"]] == [(r["step"], r["loss"]) for r in out[0]["bf16"]]
    assert all(r["at_rest"] == (2 if shard == "full" else 0) for r in out)
    saved = checkpoint_state(tmp_path / "bf16" / f"ckpt-{BF16_STEPS:07d}")
    stacked = "model.layers.0.block_sparse_moe.experts.w1"
    masters = list(saved[stacked])  # the checkpoint's logical experts, read back stacked
    assert all(m.dtype == torch.float32 for m in masters)
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)  # not the rounded copies
    for r in out:
        copies = torch.tensor(r["w1"]).to(torch.bfloat16)  # bf16 values, exact in float
        assert r["w1_dtype"] == "torch.bfloat16" and copies.shape[0] == 2
        for row in copies:  # each of the rank's 2 experts is a logical expert's master rounded
            assert any(torch.equal(m.to(torch.bfloat16), row) for m in masters)
