"""Sharded AdamW state (`parallel.shard: optimizer`) in a pipeline against the unsharded pipeline on 4 gloo ranks:
losses, gradient norms and parameters within 1e-5 relative (fp32) over 10 steps with forced migrations (between
steps, and between a backward pass and its optimizer step: gradients travel), a re-pack onto fewer stages, and
expert parallelism inside the stages; resume from a sharded pipeline checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks
from tests.distributed.shard_parity import checkpoint_state

STEPS = 10
MIGRATE = {"force": ((3, (1, 3)), (7, (2, 2))), "force_mid": ((5, (3, 1)),)}
"""Layer moves at the end of steps 3 and 7, and in step 5 between its backward pass and its optimizer step; three
steps follow the last move, so carried moments (and masters) are used by several optimizer steps."""


def pipe_cfg(shard: str, ep: int, steps: int = STEPS, dynamism: str = "none", pp: int = 2, schedule: str = "1f1b",
             options: dict[str, Any] | None = None, **train: Any) -> Config:
    return from_dict({
        "model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop", "aux_loss_coef": 0.01},
        "data": {"seq_len": 16, "batch_size": 8, "max_bytes": 200_000},
        "train": {"steps": steps, "warmup_steps": 2, "lr": 3e-3, "eval_every": 0, "precision": "fp32",
                  "grad_clip": 0.5, "threads": 1, "progress": "plain", **train},
        "parallel": {"pp": pp, "ep": ep, "nproc": 4, "shard": shard},
        "pipeline": {"micro_batches": 2, "schedule": schedule},
        "dynamism": {"scheme": dynamism, **({dynamism: options} if options else {})},
        # a fixed hardware profile: both runs of a pair plan the same placements from the same counts (measured
        # coefficients differ between runs, and so would the replicas and the order gradients are summed in)
        "planner": {"costs": "rtx3090"}})


def _run(shard: str, ep: int, knobs: dict[str, Any], pp: int, schedule: str) -> dict[str, Any]:
    import torch.distributed as dist

    from moebal.pipeline.observe import static_bytes, transfer_bytes
    from moebal.pipeline.runner import PipelineRunner

    runner = PipelineRunner(pipe_cfg(shard, ep, pp=pp, schedule=schedule), **knobs)
    out = runner.train(STEPS)
    opt = runner.optimizer
    state = [v for s in opt.state.values() for v in s.values()] if opt is not None else []
    if shard == "optimizer" and opt is not None:
        state = opt.shard_tensors()[1]  # type: ignore[attr-defined]
    res = {"records": out.records, "released": out.released, "sizes": out.final_sizes,
           "optimizer": type(opt).__name__, "state_elems": sum(t.numel() for t in state if t.dim() > 0),
           "params": {} if out.released else runner.full_state(),
           "param_elems": 0 if out.released else sum(p.numel() for p in runner.stage.parameters()),
           # the layer balancer's per-rank memory and migration-transfer estimates of the stage
           "static": 0.0 if out.released else static_bytes(runner.stage, opt),
           "transfer": 0.0 if out.released else transfer_bytes(runner.stage, opt)}
    dist.barrier()  # released ranks wait here until the survivors have finished
    return res


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12))


def pair(plain: dict[str, Any], sharded: dict[str, Any], shard: str) -> dict[str, Any]:
    """An unsharded and a sharded run of one case side by side, their final parameters reduced to the largest
    relative difference (so only records and scalars travel back from the ranks)."""
    p, s = plain.pop("params"), sharded.pop("params")
    assert p.keys() == s.keys()
    return {"none": plain, shard: sharded, "param_rel": max((_rel(s[k], p[k]) for k in p if p[k].norm() > 0),
                                                            default=0.0)}


def _pairs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    # re-packing keeps two stages at least (embedding and head): 4 stages of one rank each, onto 2; the expert-
    # parallel case runs the zero-bubble schedule (weight gradients added outside autograd)
    cases = {"dp2": (2, 1, MIGRATE, "1f1b"), "ep2": (2, 2, MIGRATE, "zb"),
             "repack": (4, 1, {"force": ((6, (2, 2)),)}, "1f1b")}
    out: dict[str, Any] = {}
    for name, (pp, ep, knobs, schedule) in cases.items():
        out[name] = pair(_run("none", ep, knobs, pp, schedule), _run("optimizer", ep, knobs, pp, schedule),
                         "optimizer")
    return out


@pytest.fixture(scope="module")
def pairs() -> list[dict[str, Any]]:
    return run_ranks(_pairs, 4, timeout_s=900)


def _check(runs: list[dict[str, Any]], name: str) -> None:
    for r in runs:
        case = r[name]
        plain, sharded = case["none"], case["optimizer"]
        assert (plain["optimizer"], sharded["optimizer"]) in (("AdamW", "ShardedAdamW"), ("NoneType", "NoneType"))
        assert plain["sizes"] == sharded["sizes"] and plain["released"] == sharded["released"]
        if plain["released"]:
            continue
        assert [x["step"] for x in sharded["records"]] == list(range(1, STEPS + 1))
        for a, b in zip(plain["records"], sharded["records"]):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (name, a["step"], a["loss"], b["loss"])
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (name, a["step"])
            assert a.get("migration") == b.get("migration") and a["sizes"] == b["sizes"]
        assert any(x["grad_norm"] > 0.5 for x in plain["records"])  # the clip acted
        assert case["param_rel"] < 1e-5, (name, case["param_rel"])


def test_sharded_pipeline_with_data_parallel_and_migrations_matches_unsharded(pairs):
    _check(pairs, "dp2")
    rec = pairs[0]["dp2"]["optimizer"]["records"]
    assert [x["migration"] for x in rec if "migration" in x] == ["forced", "forced-mid", "forced"]
    assert rec[-1]["sizes"] == [2, 2]
    for r in pairs:  # the AdamW moments are split over the stage's 2 ranks: half of the unsharded ones (+ padding)
        got, whole = r["dp2"]["optimizer"]["state_elems"], r["dp2"]["none"]["state_elems"]
        assert whole == 2 * r["dp2"]["none"]["param_elems"] and got <= whole // 2 + 8, (got, whole)
        # the balancer's estimates: a rank keeps half the moments (4 bytes per parameter less), a move sends all
        plain, sharded, n = r["dp2"]["none"], r["dp2"]["optimizer"], r["dp2"]["none"]["param_elems"]
        assert abs(plain["static"] - sharded["static"] - 4 * n) < 0.01 * plain["static"]
        assert abs(plain["transfer"] - sharded["transfer"]) < 0.01 * plain["transfer"]


def test_sharded_pipeline_with_expert_parallel_stages_and_zero_bubble_matches_unsharded(pairs):
    _check(pairs, "ep2")


def test_sharded_pipeline_repacks_like_unsharded(pairs):
    _check(pairs, "repack")
    assert sum(r["repack"]["optimizer"]["released"] for r in pairs) == 2
    assert pairs[0]["repack"]["optimizer"]["sizes"] == [2, 2]


# ---- checkpoints ------------------------------------------------------------------------------------------------

def _leg(rank: int, world: int, root: str, shard: str, resume: bool, stop: int | None, ep: int = 1,
         param_dtype: str = "fp32", precision: str = "fp32", dynamism: str = "none",
         options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One leg of a resume chain on 2 stages (a checkpoint every 2 steps, a migration after step 1 and one inside
    step 3); rank 0 returns the logged steps."""
    import dataclasses

    from moebal.distributed.groups import ParallelDims
    from moebal.train.pipelined import pipeline_trainer

    cfg = pipe_cfg(shard, ep, steps=6, ckpt_every=2, keep_checkpoints=10, precision=precision, dynamism=dynamism,
                   options=options)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, param_dtype=param_dtype))
    dims = ParallelDims(world_size=world, rank=rank, pp=2, ep=ep).init()
    trainer = pipeline_trainer(cfg, root, resume=resume, dims=dims, force=((1, (1, 3)),), force_mid=((3, (3, 1)),))
    try:
        trainer.train(stop_after=stop)
    finally:
        trainer.close()
    metrics = Path(root) / "metrics.jsonl"
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r] if rank == 0 else []


def resume_parity(tmp_path: Path, shard: str, dynamism: str = "none", options: dict[str, Any] | None = None) -> dict:
    """6 steps with migrations in one go against 4 steps, a stop, and a resume of the `shard` run from its step-4
    checkpoint (taken under a migrated partition: the resumed run migrates to it and re-shards); the same
    checkpoint resumed unsharded continues the same run too (the format does not say it was sharded). Asserts
    losses, gradient norms and the step-6 state within 1e-5; returns the resumed run's step-6 manifest. `dynamism`
    and its `options`: every leg's scheme."""
    import shutil

    def leg(root: str, shard: str, resume: bool, stop: int | None) -> list[dict[str, Any]]:
        return run_ranks(_leg, 4, root, shard, resume, stop, 1, "fp32", "fp32", dynamism, options, timeout_s=600)[0]

    whole = leg(str(tmp_path / "whole"), shard, False, None)
    run = str(tmp_path / "resumed")
    leg(run, shard, False, 4)
    shutil.copytree(run, tmp_path / "unsharded")
    resumed = leg(run, shard, True, None)
    plain = leg(str(tmp_path / "unsharded"), "none", True, None)
    assert [r["step"] for r in resumed] == [r["step"] for r in plain] == list(range(1, 7))
    for a, b, c in zip(whole, resumed, plain):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), a["step"]
        assert math.isclose(a["loss"], c["loss"], rel_tol=1e-5), (a["step"], a["loss"], c["loss"])
    ref, got = (checkpoint_state(Path(d) / "ckpt-0000006") for d in (tmp_path / "whole", run))
    assert ref.keys() == got.keys() and any(k.endswith(":exp_avg") for k in ref)
    worst = max(_rel(got[k], ref[k]) for k in ref if ref[k].norm() > 0)
    assert worst < 1e-5, worst
    return json.loads((Path(run) / "ckpt-0000006" / "manifest.json").read_text())


def test_sharded_pipeline_resumes_from_its_checkpoint_like_an_uninterrupted_run(tmp_path):
    """The resume parity of `resume_parity` under `shard: optimizer`."""
    manifest = resume_parity(tmp_path, "optimizer")
    writers = {e["file"] for k, e in manifest["tensors"].items() if k.endswith(":exp_avg")}
    assert len(writers) == 4, writers  # each stage's AdamW state written by its owners, every rank a part


EXIT = {"threshold": 0.9, "first_layer": 1}
"""Early exit whose tokens leave after layer 1 (all of them in the first steps): the attention of the later layers
has no gradient on any rank, and its step counts fall behind the other layers'."""


def test_sharded_pipeline_resumes_each_parameters_step_count_under_early_exit(tmp_path):
    """A step count per parameter (`ShardedAdamW(skips=True)`) survives the checkpoint: the resumed run and the same
    checkpoint resumed unsharded (torch's AdamW, which keeps a count per parameter) continue the uninterrupted run."""
    from moebal.train.checkpoint import read_checkpoint

    resume_parity(tmp_path, "optimizer", dynamism="early_exit", options=EXIT)
    with read_checkpoint(tmp_path / "resumed" / "ckpt-0000004") as reader:
        steps = {ln: float(reader.optimizer_state(ln)["step"]) for ln in reader.names() if reader.optimizer_keys(ln)}
    # every token leaves before layers 2 and 3 in steps 1-3 (the first tokens reach layer 2 in step 4): their
    # attention has no gradient there; the MoE block joins with zero rows (a gradient of zeros) and steps every time
    attention = "model.layers.{}.self_attn.q_proj.weight"
    assert [steps[attention.format(i)] for i in range(4)] == [4, 4, 1, 0], steps
    assert steps["model.layers.3.block_sparse_moe.gate.weight"] == 4


# ---- bf16 weights (`parallel.param_dtype: bf16`) ----------------------------------------------------------------

def _bf16_runs(rank: int, world: int) -> dict[str, Any]:
    """pp 2 x dp 2 under bf16 autocast, 1F1B and zero bubble: fp32 weights with migrations, bf16 weights with
    and without them."""
    import dataclasses

    from moebal.pipeline.runner import PipelineRunner

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for schedule in ("1f1b", "zb"):
        for name, dtype, knobs in (("fp32", "fp32", MIGRATE), ("bf16", "bf16", MIGRATE), ("unmigrated", "bf16", {})):
            cfg = pipe_cfg("optimizer", 1, schedule=schedule, precision="bf16")
            cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, param_dtype=dtype))
            runner = PipelineRunner(cfg, **knobs)
            records = runner.train(STEPS).records
            weight = next(p for n, p in runner.stage.named_parameters() if n.endswith("q_proj.weight"))
            out[f"{schedule} {name}"] = {"records": records, "dtype": str(weight.dtype)}
    return out


def test_sharded_pipeline_with_bf16_weights_sums_micro_batches_in_fp32_and_migrates_the_masters():
    """`parallel.shard: optimizer` with `parallel.param_dtype: bf16` in a pipeline (pp 2 x dp 2): the weights are
    bf16 copies, their micro-batch gradients summed in fp32 (B through a gradient hook, zero bubble's W through the
    engine's reducer); 10 steps within 2 % of the fp32-weight run under the same autocast, and the forced
    migrations (one inside a step) give the unmigrated run's losses within 1e-5: they carry the fp32 masters and
    gradient sums."""
    out = run_ranks(_bf16_runs, 4, timeout_s=900)[0]
    for schedule in ("1f1b", "zb"):
        fp32, bf16, still = (out[f"{schedule} {k}"] for k in ("fp32", "bf16", "unmigrated"))
        assert bf16["dtype"] == "torch.bfloat16" and fp32["dtype"] == "torch.float32"
        assert [x["migration"] for x in bf16["records"] if "migration" in x] == ["forced", "forced-mid", "forced"]
        for a, b, c in zip(fp32["records"], bf16["records"], still["records"], strict=True):
            assert math.isfinite(b["loss"]) and math.isclose(a["loss"], b["loss"], rel_tol=0.02), (schedule, a, b)
            assert math.isclose(b["loss"], c["loss"], rel_tol=1e-5), (schedule, b["step"], b["loss"], c["loss"])


def _bf16_leg(rank: int, world: int, root: str, resume: bool, stop: int | None) -> list[dict[str, Any]]:
    return _leg(rank, world, root, "optimizer", resume, stop, param_dtype="bf16", precision="bf16")


def test_sharded_pipeline_with_bf16_weights_resumes_from_its_fp32_masters(tmp_path):
    """bf16 weights in a pipeline: 6 steps with migrations in one go against 4, a stop and a resume from the
    step-4 checkpoint (the fp32 masters, written by their owners; the resumed run migrates back to the saved
    partition through `_masters_whole`): the same losses, and the checkpoint's weights are fp32 masters."""
    whole = run_ranks(_bf16_leg, 4, str(tmp_path / "whole"), False, None, timeout_s=600)[0]
    run = str(tmp_path / "resumed")
    run_ranks(_bf16_leg, 4, run, False, 4, timeout_s=600)
    resumed = run_ranks(_bf16_leg, 4, run, True, None, timeout_s=600)[0]
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for a, b in zip(whole, resumed, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
    saved = checkpoint_state(tmp_path / "whole" / "ckpt-0000006")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert saved[q].dtype == torch.float32 and not torch.equal(saved[q], saved[q].to(torch.bfloat16).float())


def _counts_and_weights(runner: Any) -> dict[str, tuple[int, torch.Tensor]]:
    """Each parameter of the runner's stage: its sharded optimizer's step count, and a copy of its weights."""
    opt = runner.optimizer
    return {n: (opt._steps[f][i], p.detach().clone()) for n, p in runner.stage.named_parameters()
            for f, i in [opt._of_param[id(p)]]}


def _bf16_exit(rank: int, world: int) -> dict[str, Any]:
    """Early exit (EXIT) under `optimizer` with bf16 and with fp32 weights, bf16 autocast, 6 steps with the resume
    chain's migrations, step by step: per step and parameter of the rank's stage, whether its step count moved
    and whether its weights did (a parameter held before and after the step)."""
    import dataclasses

    from moebal.pipeline.runner import PipelineRunner
    from moebal.train.pipelined import scheme_from_config

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for dtype in ("bf16", "fp32"):
        cfg = pipe_cfg("optimizer", 1, steps=6, dynamism="early_exit", options=EXIT, precision="bf16")
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, param_dtype=dtype))
        runner = PipelineRunner(cfg, scheme=scheme_from_config(cfg), force=((1, (1, 3)),), force_mid=((3, (3, 1)),))

        runner.start()
        losses, moves = [], []
        before = _counts_and_weights(runner)
        for _ in range(6):
            losses.append(runner.train_step()["loss"])
            after = _counts_and_weights(runner)
            moves += [(after[n][0] > k, not torch.equal(after[n][1], w)) for n, (k, w) in before.items() if n in after]
            before = after
        runner.close()
        out[dtype] = {"losses": losses, "moves": moves, "dtype": str(next(iter(before.values()))[1].dtype)}
    return out


def test_bf16_weights_keep_a_parameter_without_a_gradient_as_it_was():
    """`skips` with compute copies: in a step that leaves a parameter without a gradient on every rank its fp32
    master stays, so its bf16 copy is the same bits, and its count does not move; with fp32 weights a parameter's
    weights move exactly in the steps its count does. The losses within 2 % of the fp32-weight run under the same
    autocast, as without a scheme."""
    out = run_ranks(_bf16_exit, 4, timeout_s=900)
    skipped = 0
    for r in out:
        fp32, bf16 = r["fp32"], r["bf16"]
        assert all(stepped == moved for stepped, moved in fp32["moves"])
        # a bf16 copy may also stay put in a step it took: a small update of a norm's 1.0 rounds away in bf16
        assert all(stepped or not moved for stepped, moved in bf16["moves"])
        skipped += sum(not stepped for stepped, _ in bf16["moves"])
        assert bf16["dtype"] == "torch.bfloat16"
    assert skipped > 0  # some parameter went without a gradient in some step
    a, b = out[0]["fp32"]["losses"], out[0]["bf16"]["losses"]
    assert all(math.isfinite(y) and math.isclose(x, y, rel_tol=0.02) for x, y in zip(a, b, strict=True)), (a, b)


PRUNE = {"kernel": "dense", "final_sparsity": 0.8, "start": 1, "every": 2, "steps": 2}
"""Prunes at steps 3 and 5 (to 70 %, then 80 % of the prunable weights); the masked dense kernel (CPU sparse
kernels have no bf16 path)."""
PRUNED_LAYOUTS = {"optimizer, pp 2": ("optimizer", 2, 1), "full, one stage, ep 2": ("full", 1, 2)}
"""(shard, pp, ep): the sharded optimizer's compute copies in two stages with migrations; FSDP2's expert optimizer
on one stage of 4 ranks, whose 2 ranks per expert shard make the experts bf16 copies of fp32 masters."""


def _pruned_leg(rank: int, world: int, root: str, layout: str, param_dtype: str) -> list[dict[str, Any]]:
    import dataclasses

    from moebal.distributed.groups import ParallelDims
    from moebal.train.pipelined import pipeline_trainer

    shard, pp, ep = PRUNED_LAYOUTS[layout]
    cfg = pipe_cfg(shard, ep, steps=6, pp=pp, ckpt_every=6, precision="bf16", dynamism="pruning", options=PRUNE)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, param_dtype=param_dtype))
    dims = ParallelDims(world_size=world, rank=rank, pp=pp, ep=ep).init()
    force = {"force": ((1, (1, 3)),), "force_mid": ((3, (3, 1)),)} if pp > 1 else {}
    trainer = pipeline_trainer(cfg, root, dims=dims, **force)
    try:
        trainer.train()
    finally:
        trainer.close()
    metrics = Path(root) / "metrics.jsonl"
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r] if rank == 0 else []


@pytest.mark.parametrize("layout", list(PRUNED_LAYOUTS))
def test_pruning_with_bf16_weights_masks_the_fp32_gradient_sums_and_masters(tmp_path, layout):
    """Pruning where the weights are bf16 compute copies of fp32 masters (`parallel.param_dtype: bf16`): the masks
    reach the fp32 sums of the micro-batches' gradients (`ShardedAdamW.mask_grad`) before they are reduced and
    clipped, and the masters and moments at each pruning step (`mask_state`). 6 steps within 2 % of the fp32-weight
    run under the same autocast (losses and clipped gradient norms), and the checkpoint's masters hold the
    pruned fraction of zeros, their moments zero there."""
    from moebal.dynamism.pruning import _PRUNABLE_SUFFIXES

    runs = {dtype: run_ranks(_pruned_leg, 4, str(tmp_path / dtype), layout, dtype, timeout_s=600)[0]
            for dtype in ("fp32", "bf16")}
    assert [r["sparsity_target"] for r in runs["bf16"]] == [0.0, 0.0, 0.7, 0.7, 0.8, 0.8]
    for a, b in zip(runs["fp32"], runs["bf16"], strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=0.02), (layout, a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=0.02), (layout, a["step"], a["grad_norm"],
                                                                             b["grad_norm"])
    saved = checkpoint_state(tmp_path / "bf16" / "ckpt-0000006")
    pruned = {k: v for k, v in saved.items() if k.endswith(_PRUNABLE_SUFFIXES)}
    zeros, total = sum(int((v == 0).sum()) for v in pruned.values()), sum(v.numel() for v in pruned.values())
    assert all(v.dtype == torch.float32 for v in pruned.values())  # the masters
    assert abs(zeros / total - 0.8) < 1e-3, zeros / total
    for k, v in pruned.items():
        # an expert-stacked matrix [E, ...] keeps its moments per expert (`experts.E.w1`)
        head, stacked, w = k.rpartition(".experts.")
        rows = [(f"{head}.experts.{e}.{w}", v[e]) for e in range(v.shape[0])] if stacked else [(k, v)]
        for name, weight in rows:
            for moment in ("exp_avg", "exp_avg_sq"):
                assert not saved[f"{name}:{moment}"][weight == 0].any(), (name, moment)
