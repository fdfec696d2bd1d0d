"""Fully sharded model state (`parallel.shard: full`: FSDP2 per layer over each stage's ranks) in a pipeline
against the unsharded pipeline on 4 gloo ranks (pp 2 x dp 2): losses, gradient norms and parameters within 1e-5
relative (fp32) over 20 steps with forced migrations (between steps, and between a backward pass and its
optimizer step: gradients travel); refusals of what is not built."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

from moebal.distributed.testing import run_ranks
from moebal.errors import ConfigError
from tests.distributed.test_pipeline_sharded import MIGRATE, STEPS, _rel, pipe_cfg


def _run(shard: str) -> dict[str, Any]:
    from moebal.pipeline.observe import static_bytes
    from moebal.pipeline.runner import PipelineRunner

    runner = PipelineRunner(pipe_cfg(shard, 1), **MIGRATE)
    out = runner.train(STEPS)
    opt = runner.optimizer
    assert opt is not None
    grads, state = opt.shard_tensors() if shard == "full" else ([], [v for s in opt.state.values()  # type: ignore
                                                                          for v in s.values()])
    return {"records": out.records, "sizes": out.final_sizes, "optimizer": type(opt).__name__,
            "state_elems": sum(t.numel() for t in state if t.dim() > 0),
            "param_elems": sum(p.numel() for p in runner.full_state().values()),
            "params": runner.full_state(), "static": static_bytes(runner.stage, opt)}


def _pairs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    plain, full = _run("none"), _run("full")
    p, s = plain.pop("params"), full.pop("params")
    assert p.keys() == s.keys()
    return {"none": plain, "full": full,
            "param_rel": max((_rel(s[k], p[k]) for k in p if p[k].norm() > 0), default=0.0)}


@pytest.fixture(scope="module")
def pairs() -> list[dict[str, Any]]:
    return run_ranks(_pairs, 4, timeout_s=900)


def test_fully_sharded_pipeline_with_migrations_matches_unsharded(pairs):
    for r in pairs:
        plain, full = r["none"], r["full"]
        assert (plain["optimizer"], full["optimizer"]) == ("AdamW", "StageShardedAdamW")
        assert plain["sizes"] == full["sizes"] == [2, 2]
        assert [x["step"] for x in full["records"]] == list(range(1, STEPS + 1))
        for a, b in zip(plain["records"], full["records"]):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (a["step"], a["grad_norm"],
                                                                                 b["grad_norm"])
            assert a.get("migration") == b.get("migration") and a["sizes"] == b["sizes"]
        assert any(x["grad_norm"] > 0.5 for x in plain["records"])  # the clip acted
        assert r["param_rel"] < 1e-5, r["param_rel"]
        # the stage's AdamW moments are split over its 2 ranks: half of the unsharded ones (+ padding)
        whole, got = plain["state_elems"], full["state_elems"]
        assert whole == 2 * plain["param_elems"] and got <= whole // 2 + 64, (got, whole)
        assert full["static"] < plain["static"]
    rec = pairs[0]["full"]["records"]
    assert [x["migration"] for x in rec if "migration" in x] == ["forced", "forced-mid", "forced"]


@pytest.mark.parametrize("knobs, words", [
    ({"schedule": "zb"}, "is not built with pipeline.schedule=zb"),
    ({"dynamism": "pruning"}, "is not built with dynamism.scheme=pruning"),
    ({"ep": 2}, "is not built with parallel.ep 2 inside the stages"),
])
def test_fully_sharded_pipeline_refusals_name_the_setting(knobs, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        pipe_cfg("full", knobs.pop("ep", 1), **knobs)


@pytest.mark.parametrize("pipeline, words", [
    ({"repack": True, "rebalance": "partition"}, "is not built with pipeline.repack"),
    ({"microbatching": "dynamic"}, "is not built with pipeline.microbatching=dynamic"),
    ({"split_layers": True}, "is not built with pipeline.split_layers"),
])
def test_fully_sharded_pipeline_refuses_what_moves_ranks_or_splits_layers(pipeline, words):
    from moebal.config import from_dict

    with pytest.raises(ConfigError, match=re.escape(words)):
        from_dict({"parallel": {"pp": 2, "shard": "full"}, "pipeline": pipeline, "model": {"n_layers": 2}})


def test_fully_sharded_pipeline_resumes_from_its_checkpoint_like_an_uninterrupted_run(tmp_path):
    """6 steps with migrations in one go against 4 steps, a stop, and a resume of the fully sharded run from its
    step-4 checkpoint (taken under a migrated partition: the resumed run migrates to it and re-shards); the same
    checkpoint resumed unsharded continues the same run too (the format does not say it was sharded)."""
    import json
    import shutil
    from pathlib import Path

    from tests.distributed.shard_parity import checkpoint_state
    from tests.distributed.test_pipeline_sharded import _leg

    whole = run_ranks(_leg, 4, str(tmp_path / "whole"), "full", False, None, timeout_s=600)[0]
    run = str(tmp_path / "resumed")
    run_ranks(_leg, 4, run, "full", False, 4, timeout_s=600)
    shutil.copytree(run, tmp_path / "unsharded")
    resumed = run_ranks(_leg, 4, run, "full", True, None, timeout_s=600)[0]
    plain = run_ranks(_leg, 4, str(tmp_path / "unsharded"), "none", True, None, timeout_s=600)[0]
    assert [r["step"] for r in resumed] == [r["step"] for r in plain] == list(range(1, 7))
    for a, b, c in zip(whole, resumed, plain):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), a["step"]
        assert math.isclose(a["loss"], c["loss"], rel_tol=1e-5), (a["step"], a["loss"], c["loss"])
    ref, got = (checkpoint_state(Path(d) / "ckpt-0000006") for d in (tmp_path / "whole", run))
    assert ref.keys() == got.keys() and any(k.endswith(":exp_avg") for k in ref)
    worst = max(_rel(got[k], ref[k]) for k in ref if ref[k].norm() > 0)
    assert worst < 1e-5, worst
    manifest = json.loads((Path(run) / "ckpt-0000006" / "manifest.json").read_text())
    pieced = {k: e for k, e in manifest["tensors"].items() if k.endswith(":exp_avg") and "pieces" in e}
    writers = {p["file"] for e in pieced.values() for p in e["pieces"]}
    assert pieced and all(len(e["pieces"]) == 2 for e in pieced.values())  # rows written by the 2 owners
    assert len(writers) == 4, writers  # each stage's AdamW state written by its owners, every rank a part
