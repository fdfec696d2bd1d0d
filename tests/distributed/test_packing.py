"""Lina's expert packing at start-up (moebal/balance/packing.py): measured on real ranks, decided alike everywhere,
recorded and read back on resume."""

from __future__ import annotations

import json

import pytest
import torch

from moebal.balance import packing
from moebal.distributed.testing import run_ranks
from moebal.errors import ConfigError
from moebal.planner.comm_plan import PackingCandidate
from tests.unit.test_train import tiny


def _measure(rank: int, world: int) -> list[dict]:
    from torch.distributed.distributed_c10d import _world

    cfg = tiny("moe.num_experts=4", "scheduler.expert_packing=lina")
    groups = len(_world.pg_map)
    cands = packing._measured(cfg, world, rank, torch.device("cpu"), [2, 1], 60.0, 1.0)
    # the candidates' process groups are gone (NCCL communicators would hold device memory for the whole run)
    assert len(_world.pg_map) == groups, (groups, len(_world.pg_map))
    return [vars(c) for c in cands]


def _measure_stages(rank: int, world: int) -> list[dict]:
    cfg = tiny("moe.num_experts=4", "scheduler.expert_packing=lina", "parallel.pp=2", "parallel.nproc=4")
    cands = packing._measured(cfg, world, rank, torch.device("cpu"), [2, 1], 60.0, 1.0, pp=2)
    return [vars(c) for c in cands]


def test_measured_candidates_of_pipeline_stages_count_a_stage_s_ranks():
    """2 stages x 2 ranks: the layouts are those of a stage's 2 ranks (both stages measure at once), and the
    rows of one exchange are a micro-batch's share of one rank of the stage."""
    got = run_ranks(_measure_stages, 4)
    assert all(g == got[0] for g in got)
    assert [c["ep"] for c in got[0]] == [2, 1]
    assert got[0][0]["t_a2a"] > 0 and got[0][1]["t_a2a"] == 0.0
    assert got[0][0]["t_expert_sync"] == 0.0 and got[0][1]["t_expert_sync"] > 0  # 2 copies in a stage, not 4
    cfg = tiny("moe.num_experts=4", "parallel.pp=2", "parallel.nproc=4", "pipeline.micro_batches=2")
    assert packing.exchange_tokens(cfg, 2) == cfg.data.batch_size * cfg.data.seq_len // 2 // 2


def test_measured_candidates_are_the_same_on_every_rank():
    a, b = run_ranks(_measure, 2)
    assert a == b  # every rank decides from the slowest rank's figures
    assert [c["ep"] for c in a] == [2, 1]
    assert a[0]["t_a2a"] > 0 and a[1]["t_a2a"] == 0.0  # one expert-parallel rank: no all-to-all left
    assert a[0]["t_expert_sync"] == 0.0 and a[1]["t_expert_sync"] > 0  # ... but two copies of every expert
    assert all(c["t_ffn"] > 0 for c in a)


def test_a_decision_is_written_and_a_resume_reads_it(tmp_path, monkeypatch):
    cfg = tiny("moe.num_experts=4", "scheduler.expert_packing=lina", "planner.costs=a100")
    monkeypatch.setattr(packing, "_profiled", lambda cfg, world, eps, device: [
        PackingCandidate(2, 1e-4, 9e-4, 0.0), PackingCandidate(1, 1e-4, 0.0, 2e-4)])
    assert packing.choose_expert_parallel(cfg, 2, 0, torch.device("cpu"), 2, tmp_path) == 1
    record = json.loads((tmp_path / "packing.json").read_text())
    assert record["ep"] == 1 and record["start_ep"] == 2 and "2 -> 1" in record["decisions"][0]
    monkeypatch.setattr(packing, "_profiled", lambda *a: pytest.fail("a resume must not decide again"))
    assert packing.choose_expert_parallel(cfg, 2, 1, torch.device("cpu"), 2, tmp_path, resume=True) == 1
    (tmp_path / "packing.json").write_text("{not json")
    with pytest.raises(ConfigError, match="packing.json is damaged"):
        packing.choose_expert_parallel(cfg, 2, 0, torch.device("cpu"), 2, tmp_path, resume=True)
    off = tiny("moe.num_experts=4")
    assert packing.choose_expert_parallel(off, 2, 0, torch.device("cpu"), 2, tmp_path) == 2


def test_packing_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="expert_packing: lina"):
        tiny("scheduler.expert_packing=lina", "moe.num_experts=0")
