"""Tied embeddings (`model.tie_embeddings`) across pipeline stages (moebal/pipeline/tied.py): the first stage's
embedding and the last stage's head copy train as one tensor.

Against the single-process tied model: the losses, every weight, and the gradient norm (the tied gradient
counted once: the clip limit is set low so that every step clips). Bitwise between partitions (forced
migrations, gradients in flight included), between the 1F1B and zero-bubble schedules, through freezing (which
stops the embedding and its copy together) and through a checkpoint resumed on the same layout. With
data-parallel replicas, each pipeline's last stage sends its replica's head gradient to its own first stage.
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


def tied(n_layers: int = 4, pp: int = 2, nproc: int | None = None, **train: float) -> Config:
    cfg = tiny(n_layers=n_layers, pp=pp, nproc=nproc, grad_clip=CLIP, **train)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tie_embeddings=True))


FREEZE = {"threshold": 10.0, "check_every": 2, "max_fraction": 0.5}  # freezes (the embedding with it) at step 2


def _resumed(rank: int, tmp: str) -> dict:
    """A 6-step tied run with a checkpoint after step 3, and the same run resumed from it."""
    import torch.distributed as dist

    from moebal.distributed.groups import ParallelDims
    from moebal.train.pipelined import pipeline_trainer

    cfg = tied()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=6, ckpt_every=3, keep_checkpoints=10,
                                                             threads=1),
                              pipeline=dataclasses.replace(cfg.pipeline, micro_batches=2))
    base, out = Path(tmp), {}
    for key, resume in (("whole", False), ("resumed", True)):
        if resume:
            if rank == 0:
                shutil.copytree(base / "whole", base / "resumed")
                shutil.rmtree(base / "resumed" / "ckpt-0000006")
            dist.barrier()
        dims = ParallelDims(world_size=2, rank=rank, pp=2, ep=1).init()
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
    }


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return run_ranks(_two, 2, str(tmp_path_factory.mktemp("tied")), timeout_s=300)


def _four(rank: int, world: int) -> dict:
    dp = tied(pp=2, nproc=4)  # 2 stages x 2 data-parallel replicas
    return {"dp": _train(dp, 4, micro_batches=2), "dp_forced": _train(dp, 4, micro_batches=2, force=((2, (1, 3)),))}


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


def test_tied_stages_with_data_parallel_replicas_match_the_single_process_model(four):
    ref, _ = reference_losses(tied(), 4, micro=2)
    got = four[0]["dp"]["losses"]
    assert all(r["dp"]["losses"] == got and r["dp_forced"]["losses"] == got for r in four)
    assert all(math.isclose(a, b, rel_tol=2e-6) for a, b in zip(got, ref)), (got, ref)
    for r in four:
        assert r["dp_forced"]["sizes"] == [1, 3]
    states = [r["dp"]["state"] for r in four]
    embeds = [s["model.embed_tokens.weight"] for s in states if "model.embed_tokens.weight" in s]
    heads = [s["lm_head.weight"] for s in states if "lm_head.weight" in s]
    assert len(embeds) == len(heads) == 2  # each pipeline's first and last stage: one tensor everywhere
    assert all((h == embeds[0]).all() for h in [*embeds, *heads])
