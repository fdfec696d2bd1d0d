"""Tied embeddings (`model.tie_embeddings`) across pipeline stages (moebal/pipeline/tied.py): the first stage's
embedding and the last stage's head copy train as one tensor.

Against the single-process tied model: the losses, every weight, and the gradient norm (the tied gradient
counted once: the clip limit is set low so that every step clips). Bitwise between partitions (forced
migrations, gradients in flight included), between the 1F1B and zero-bubble schedules, through freezing (which
stops the embedding and its copy together) and through a checkpoint resumed on the same layout. With
data-parallel replicas, each pipeline's last stage sends its replica's head gradient to its own first stage.
A scheme's one-stage pipeline under `parallel.shard: full` gives its head a copy of its own, which trains as the
unsharded one-stage run's tied weight.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from moebal.config import Config
from moebal.distributed.testing import run_ranks
from tests.distributed.test_pipeline import _merge, _train, reference_losses, tiny

CLIP = 0.05  # below every step's gradient norm: each step clips, so a norm counting the tied gradient twice shows


def tied(n_layers: int = 4, pp: int = 2, nproc: int | None = None, shard: str = "none", param_dtype: str = "fp32",
         **train: float | str) -> Config:
    cfg = tiny(n_layers=n_layers, pp=pp, nproc=nproc, grad_clip=CLIP, **train)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tie_embeddings=True),
                               parallel=dataclasses.replace(cfg.parallel, shard=shard, param_dtype=param_dtype))


FREEZE = {"threshold": 10.0, "check_every": 2, "max_fraction": 0.5}  # freezes (the embedding with it) at step 2
SPARSE = {"budget": "random_walk", "block": 4, "min_density": 0.05, "walk_step": 0.5, "start": 1, "costs": "given"}
"""Dynamic sparse attention: trains every weight, the densities moving from step 1."""


def _resumed(rank: int, tmp: str, one_stage_full: bool = False) -> dict:
    """A 6-step tied run with a checkpoint after step 3, and the same run resumed from it: two stages, or one
    fully sharded stage over both ranks under a scheme."""
    import torch.distributed as dist

    from moebal.distributed.groups import ParallelDims
    from moebal.train.pipelined import pipeline_trainer

    pp = 1 if one_stage_full else 2
    cfg = tied(pp=pp, nproc=2, shard="full" if one_stage_full else "none")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=6, ckpt_every=3, keep_checkpoints=10,
                                                             threads=1),
                              pipeline=dataclasses.replace(cfg.pipeline, micro_batches=2))
    if one_stage_full:
        cfg = dataclasses.replace(cfg, dynamism=dataclasses.replace(
            cfg.dynamism, scheme="sparse_attention",
            sparse_attention=dataclasses.replace(cfg.dynamism.sparse_attention, **SPARSE)))
    base, out = Path(tmp) / ("one_stage" if one_stage_full else "two_stages"), {}
    for key, resume in (("whole", False), ("resumed", True)):
        if resume:
            if rank == 0:
                shutil.copytree(base / "whole", base / "resumed")
                shutil.rmtree(base / "resumed" / "ckpt-0000006")
            dist.barrier()
        dims = ParallelDims(world_size=2, rank=rank, pp=pp, ep=1).init()
        trainer = pipeline_trainer(cfg, base / key, resume=resume, dims=dims)
        try:
            trainer.train()
        finally:
            trainer.close()
        dist.barrier()
        out[key] = [json.loads(line)["loss"] for line in (base / key / "metrics.jsonl").read_text().splitlines()]
    return out


def _two(rank: int, world: int, tmp: str) -> dict:
    torch.manual_seed(99 + rank)  # a different global RNG state per rank must not matter
    six = tied(n_layers=6)
    return {
        "1f1b": _train(tied(), 4, micro_batches=4),
        "zb": _train(tied(), 4, micro_batches=4, schedule="zb"),
        "static": _train(six, 5, micro_batches=2),
        "forced": _train(six, 5, micro_batches=2, force_mid=((2, (5, 1)),), force=((3, (2, 4)),)),
        "freezing_static": _train(six, 6, "freezing", FREEZE, micro_batches=2),
        "freezing_forced": _train(six, 6, "freezing", FREEZE, micro_batches=2, force=((1, (4, 2)),)),
        "freezing_short": _train(six, 3, "freezing", FREEZE, micro_batches=2),
        "resume": _resumed(rank, tmp),
        # a scheme's one stage over both ranks (data parallel): unsharded, its head the embedding's tensor, and
        # under `full`, its head a copy of its own
        "one_stage": {shard: {name: _train(tied(n_layers=6, pp=1, nproc=2, shard=shard), 6, name, opts,
                                           micro_batches=2)
                              for name, opts in (("freezing", FREEZE), ("sparse_attention", SPARSE))}
                      for shard in ("none", "full")},
        "one_stage_resume": _resumed(rank, tmp, one_stage_full=True),
        # bf16 autocast, unsharded and under full with bf16 compute copies (the copy stays fp32: autocast casts it)
        "one_stage_bf16": {shard: _train_bf16(tied(n_layers=6, pp=1, nproc=2, shard=shard, precision="bf16",
                                                   param_dtype="bf16" if shard == "full" else "fp32"),
                                              4, scheme="sparse_attention", options=SPARSE)
                           for shard in ("none", "full")},
    }


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return run_ranks(_two, 2, str(tmp_path_factory.mktemp("tied")), timeout_s=480)


MIGRATE = {"force": ((2, (1, 3)),), "force_mid": ((3, (3, 1)),)}  # one move between steps, one inside step 3


def _four(rank: int, world: int) -> dict:
    dp = tied(pp=2, nproc=4)  # 2 stages x 2 data-parallel replicas
    bf16 = {"precision": "bf16"}
    return {"dp": _train(dp, 4, micro_batches=2), "dp_forced": _train(dp, 4, micro_batches=2, force=((2, (1, 3)),)),
            # the sharded optimizer: fp32 weights, and bf16 compute copies (the head copy fp32, taking their values)
            "zero": _train(tied(nproc=4, shard="optimizer"), 4, micro_batches=2, **MIGRATE),
            "bf16": _train(tied(nproc=4, **bf16), 4, micro_batches=2),
            "zero_bf16": _train_bf16(tied(nproc=4, shard="optimizer", param_dtype="bf16", **bf16), 4),
            "zero_bf16_migrated": _train_bf16(tied(nproc=4, shard="optimizer", param_dtype="bf16", **bf16), 4,
                                              **MIGRATE),
            # fully sharded stages: the embedding an FSDP2 unit, the head copy whole; per micro-batch
            # reduce-scatters with migrations, whole sums under zero bubble, and bf16 compute copies
            "fsdp": _train(tied(nproc=4, shard="full"), 4, micro_batches=2, **MIGRATE),
            "fsdp_whole_zb": _train(_whole(tied(nproc=4, shard="full")), 4, micro_batches=2, schedule="zb"),
            "fsdp_bf16": _train_bf16(tied(nproc=4, shard="full", param_dtype="bf16", **bf16), 4, **MIGRATE)}


def _whole(cfg: Config) -> Config:
    """`parallel.accumulate: whole`: each unit's micro-batch gradients add up whole, reduce-scattered once."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, accumulate="whole"))


def _train_bf16(cfg: Config, steps: int, scheme: str = "none", options: dict | None = None, **knobs: tuple) -> dict:
    """`_train` for bf16 weights (numpy has no bf16): the state as fp32 values, with each tensor's dtype."""
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.runner import PipelineRunner
    from moebal.pipeline.tied import TiedEmbedding

    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, micro_batches=2))
    pending: list[list[tuple[int, ...]]] = []  # the sends a stage still holds after sharing the stepped weight
    share = TiedEmbedding.share_weight

    def spy(self: TiedEmbedding) -> None:
        share(self)
        pending.append([tuple(t.shape) for _, t in self.chain._pending])

    TiedEmbedding.share_weight = spy  # type: ignore[method-assign]  # this rank's process only
    try:
        runner = PipelineRunner(cfg, scheme=build_dynamism(scheme, options or {}, cfg=cfg), **knobs)
        out = runner.train(steps)
    finally:
        TiedEmbedding.share_weight = share  # type: ignore[method-assign]
    state = runner.full_state()
    return {"records": out.records, "state": {k: v.float().numpy() for k, v in state.items()},
            "dtypes": {k: str(v.dtype) for k, v in state.items()}, "pending_sends": pending}


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_ranks(_four, 4)


def _one(states: list[dict]) -> dict[str, torch.Tensor]:
    """The merged state, checked to hold one tied tensor: the head's copy equals the embedding bit for bit."""
    state = _merge(states)
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    return state


def _first_norm(cfg: Config) -> float:
    """The single-process tied model's gradient norm at step 1 (torch's clip_grad_norm_ over its parameters)."""
    from moebal.data import build_data
    from moebal.models import build_model
    from moebal.train.trainer import seed_everything

    data = build_data(cfg)
    seed_everything(cfg.train.seed)
    model = build_model(cfg)
    b = data.train.next_batch()
    out = model(b.ids_BT, b.labels_BT)
    (out.loss + out.aux_loss).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip))


def test_tied_pipeline_matches_the_single_process_tied_model(two):
    ref, ref_state = reference_losses(tied(), 4, micro=4)
    got = two[0]["1f1b"]["losses"]
    assert got == two[1]["1f1b"]["losses"]
    assert all(math.isclose(a, b, rel_tol=2e-6) for a, b in zip(got, ref)), (got, ref)
    state = _one([r["1f1b"]["state"] for r in two])
    assert set(state) == set(ref_state)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=k)
    norm = two[0]["1f1b"]["records"][0]["grad_norm"]
    want = _first_norm(tied())
    assert want > 2 * CLIP and math.isclose(norm, want, rel_tol=1e-5), (norm, want)  # counted once, and clipped


def test_tied_stages_keep_their_losses_bitwise_under_migrations_and_schedules(two):
    assert two[0]["zb"]["losses"] == two[0]["1f1b"]["losses"]
    a, b = _one([r["1f1b"]["state"] for r in two]), _one([r["zb"]["state"] for r in two])
    assert all(torch.equal(a[k], b[k]) for k in a)
    static = _one([r["static"]["state"] for r in two])
    assert two[0]["forced"]["losses"] == two[0]["static"]["losses"]
    assert two[0]["forced"]["sizes"] == [2, 4]
    forced = _one([r["forced"]["state"] for r in two])
    assert all(torch.equal(forced[k], static[k]) for k in static)


def test_freezing_stops_the_embedding_and_its_head_copy_together(two):
    runs = two[0]["freezing_static"], two[0]["freezing_forced"]
    assert runs[0]["records"][-1]["frozen_layers"] >= 1
    assert runs[1]["losses"] == runs[0]["losses"]
    states = [_one([r[k]["state"] for r in two]) for k in ("freezing_static", "freezing_forced")]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    # frozen at step 2: the tied weight after 6 steps is what step 2 left (and step 3 did not move), on both
    # stages (`_one` checks the copy), while the layers that still train moved on
    short = _one([r["freezing_short"]["state"] for r in two])
    assert two[0]["freezing_short"]["records"][1]["frozen_layers"] >= 1
    assert torch.equal(short["model.embed_tokens.weight"], states[0]["model.embed_tokens.weight"])
    down = "model.layers.5.mlp.down_proj.weight"
    assert not torch.equal(short[down], states[0][down])


def test_a_tied_pipeline_checkpoint_resumes_bitwise(two):
    runs = two[0]["resume"]
    assert len(runs["whole"]) == 6 and runs["resumed"] == runs["whole"]


def test_a_scheme_s_one_stage_under_full_sharding_trains_the_tied_weight_as_unsharded(two):
    """The one-stage pipeline shards its embedding and head as units of their own under `full`: the head takes a
    copy whose gradient is reduce-scattered into the embedding's shards and which takes the stepped weight back.
    Within 1e-5 of the unsharded one-stage run (losses, clipped gradient norms, every weight), the copy equal to the
    embedding; freezing stops both; a checkpoint resumes bit for bit. The unsharded one stage counts its tied
    gradient once too (it sits in the embedding's and the head's slot): its first clipped norm is the single-process
    model's (it was summed over the ranks twice and squared twice before)."""
    want_norm = _first_norm(tied(n_layers=6, pp=1, nproc=1))
    for name in ("freezing", "sparse_attention"):
        plain, full = (two[0]["one_stage"][shard][name] for shard in ("none", "full"))
        assert math.isclose(plain["records"][0]["grad_norm"], want_norm, rel_tol=1e-5), (name, want_norm)
        assert [r["one_stage"]["full"][name]["losses"] for r in two] == [full["losses"]] * 2
        for a, b in zip(plain["records"], full["records"], strict=True):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5) and \
                math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (name, a, b)
        want = _one([plain["state"]])
        got = {k: torch.as_tensor(v) for k, v in full["state"].items()}
        assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"]) and set(got) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    plain, full = (two[0]["one_stage_bf16"][shard] for shard in ("none", "full"))
    for a, b in zip(plain["records"], full["records"], strict=True):  # bf16 compute copies: within 2 %
        assert math.isclose(a["loss"], b["loss"], rel_tol=0.02), (a, b)
    got = {k: torch.as_tensor(v) for k, v in full["state"].items()}
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    assert full["dtypes"]["lm_head.weight"] == "torch.float32"
    frozen = two[0]["one_stage"]["full"]["freezing"]["records"]
    assert frozen[-1]["frozen_layers"] >= 1
    runs = two[0]["one_stage_resume"]
    assert len(runs["whole"]) == 6 and runs["resumed"] == runs["whole"]


def test_tied_stages_with_data_parallel_replicas_match_the_single_process_model(four):
    ref, _ = reference_losses(tied(), 4, micro=2)
    got = four[0]["dp"]["losses"]
    assert all(r["dp"]["losses"] == got and r["dp_forced"]["losses"] == got for r in four)
    assert all(math.isclose(a, b, rel_tol=2e-6) for a, b in zip(got, ref)), (got, ref)
    for r in four:
        assert r["dp_forced"]["sizes"] == [1, 3]
    _one_per_pipeline([r["dp"]["state"] for r in four])


def _one_per_pipeline(states: list[dict]) -> None:
    """Each pipeline's embedding (first stage) and head copy (last stage), 2 pipelines of 2 stages: one tensor on
    every replica."""
    embeds = [s["model.embed_tokens.weight"] for s in states if "model.embed_tokens.weight" in s]
    heads = [s["lm_head.weight"] for s in states if "lm_head.weight" in s]
    assert len(embeds) == len(heads) == 2
    assert all((torch.as_tensor(h) == torch.as_tensor(embeds[0])).all() for h in [*embeds, *heads])


def test_tied_stages_under_the_sharded_optimizer_match_unsharded(four):
    """`parallel.shard: optimizer` (pp 2 x dp 2): fp32 weights within 1e-5 of the unsharded run (losses, gradient
    norms), through a migration between steps and one inside a step; bf16 compute copies within 2 % of fp32
    weights under the same autocast, and migrated within 1e-5 of unmigrated. The head copy holds the compute
    copy's values exactly (it stays fp32: no flat holds it)."""
    plain, zero = four[0]["dp"]["records"], four[0]["zero"]["records"]
    for a, b in zip(plain, zero, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5) and math.isclose(a["grad_norm"], b["grad_norm"],
                                                                                 rel_tol=1e-5), (a, b)
    assert [r.get("migration") for r in zero] == [None, "forced", "forced-mid", None]
    _one_per_pipeline([r["zero"]["state"] for r in four])
    for a, b, c in zip(four[0]["bf16"]["records"], four[0]["zero_bf16"]["records"],
                       four[0]["zero_bf16_migrated"]["records"], strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=0.02) and math.isclose(b["loss"], c["loss"], rel_tol=1e-5)
    _one_per_pipeline([r["zero_bf16"]["state"] for r in four])  # the head copy: the bf16 copy's values exactly, in fp32
    dtypes = {k: v for r in four for k, v in r["zero_bf16"]["dtypes"].items()}
    assert dtypes["model.embed_tokens.weight"] == "torch.bfloat16" and dtypes["lm_head.weight"] == "torch.float32"


def test_tied_stages_under_full_sharding_match_unsharded(four):
    """`parallel.shard: full` (pp 2 x dp 2): the first stage's embedding is an FSDP2 unit, the last stage's head
    copy whole on each rank; the head's gradient is reduce-scattered into the embedding's shards after FSDP2's own,
    and the stepped weight gathered whole before it goes to the copy. fp32 within 1e-5 of the unsharded run (losses,
    gradient norms) through a migration between steps and one inside a step, and with whole gradient sums under the
    zero-bubble schedule; bf16 compute copies within 2 % of the unsharded bf16 run. Each pipeline's copy equals the
    embedding bit for bit."""
    plain = four[0]["dp"]["records"]
    for run in ("fsdp", "fsdp_whole_zb"):
        for a, b in zip(plain, four[0][run]["records"], strict=True):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5) and \
                math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (run, a, b)
        _one_per_pipeline([r[run]["state"] for r in four])
    assert [r.get("migration") for r in four[0]["fsdp"]["records"]] == [None, "forced", "forced-mid", None]
    for a, b in zip(four[0]["bf16"]["records"], four[0]["fsdp_bf16"]["records"], strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=0.02), (a, b)
    _one_per_pipeline([r["fsdp_bf16"]["state"] for r in four])
    # the stepped weight, gathered whole for the copy, is not held after its send (into the next step, on gloo)
    sends = [r["fsdp_bf16"]["pending_sends"] for r in four]
    assert all(len(s) == 4 and s == [[]] * 4 for s in sends), sends
