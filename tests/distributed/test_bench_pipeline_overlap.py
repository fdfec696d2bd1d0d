"""`scripts/bench_pipeline_overlap.py` on 4 gloo ranks with a tiny MoE: both variants train side by side in the same
processes with the same placements and losses, and the skew makes Pro-Prophet replicate."""

from __future__ import annotations

import dataclasses
import importlib
import sys

from moebal.config import to_dict
from moebal.distributed.testing import run_ranks
from tests.distributed.test_bench_expert_feedback import ROOT
from tests.distributed.test_pipeline_ep import moe_cfg


def test_overlap_off_and_on_train_side_by_side_with_the_same_losses(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # spawned ranks import the script from the same path
    try:
        bench = importlib.import_module("bench_pipeline_overlap")
        cfg = moe_cfg(policy="prophet")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4),
                                  pipeline=dataclasses.replace(cfg.pipeline, micro_batches=2))
        out = run_ranks(bench.worker, 4, {"config": to_dict(cfg), "rounds": 1, "skew": 1.0}, timeout_s=300)
    finally:
        sys.modules.pop("bench_pipeline_overlap", None)
    for rank in out:
        (rnd,) = rank["rounds"]
        assert [r["step"] for r in rnd["off"]] == [r["step"] for r in rnd["on"]] == [1, 2, 3, 4]
        assert [r["loss"] for r in rnd["off"]] == [r["loss"] for r in rnd["on"]]
        assert sum(sum(r["replicas"]) for r in rnd["on"]) > 0
