"""Host reads of a pipeline step (docs/gpu.md): inside the schedule the engine reads nothing back from the device,
whatever the dynamism scheme, except what a scheme's dynamic shapes need (early exit's token counts), each
through `moebal.sync.to_host` with its reason; the step's bookkeeping reads the device once for the routing
statistics and once for the loss, auxiliary losses and gradient squares together (and once more for what a
scheme or the curriculum reads on that step).

On a CPU the audit sees every Python-level read of a tensor (device or host alike); the engine's own host numbers
are therefore kept out of tensors, so an unaccounted read here is one a GPU would pay for. 2 gloo stages, the
grouped-GEMM expert kernel (no per-layer count read on one device), 2 micro-batches, the fourth step audited.
"""

from __future__ import annotations

import dataclasses

import pytest

from moebal.distributed.testing import run_ranks
from tests.distributed.test_one_stage_schemes import ALL
from tests.distributed.test_pipeline import pipeline_cfg, tiny

CURRICULUM = "curriculum"
"""No scheme, `data.order: complexity` under adaptive gating (each forward measures its rows on the device)."""
COVERAGE = "sparse_attention coverage"
"""Sparse attention under its default budget, `coverage`: every attention layer measures on the device, and the
step reads the sums once (the random walk of `ALL` measures nothing)."""
MOE = ("none", "moe", CURRICULUM)
"""Runs on an MoE model here (the other schemes on a dense one, as the scheme tests run them)."""
OPTIONS = {**ALL, COVERAGE: {**ALL["sparse_attention"], "budget": "coverage"}}


def _audited(rank: int, world: int) -> dict:
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.runner import PipelineRunner
    from moebal.sync import audit

    out = {}
    for name in ("none", *OPTIONS, CURRICULUM):
        cfg = tiny(n_layers=6, pp=2, moe=4 if name in MOE else 0)
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, kernel="grouped_mm"))
        if name == CURRICULUM:
            cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, adaptive_threshold=0.02),
                                      data=dataclasses.replace(cfg.data, order="complexity"))
        scheme = {CURRICULUM: "none", COVERAGE: "sparse_attention"}.get(name, name)
        runner = PipelineRunner(pipeline_cfg(cfg, {"micro_batches": 2}),
                                scheme=build_dynamism(scheme, OPTIONS.get(name, {}), cfg=cfg))
        try:
            for _ in range(3):  # past the schemes' start steps (early exit, sparse attention, pruning)
                runner.train_step()
            step = runner.step + 1
            work, count = runner._next_input()
            runner.scheme.begin_step(step)
            with audit() as engine:
                runner._run_engine(work, count)
            with audit() as whole:
                runner.train_step()
        finally:
            runner.close()
        out[name] = {"engine": dict(engine.counted), "engine_unaccounted": engine.unaccounted,
                     "step": dict(whole.counted)}
    return out


@pytest.fixture(scope="module")
def audits() -> list[dict]:
    return run_ranks(_audited, 2, timeout_s=300)


@pytest.mark.parametrize("scheme", ["none", *OPTIONS, CURRICULUM])
def test_the_pipeline_engine_reads_nothing_back_inside_the_schedule(audits, scheme):
    for rank, a in enumerate(audits):
        got = a[scheme]
        assert got["engine_unaccounted"] == [], (rank, got["engine_unaccounted"])
        if scheme == "early_exit":  # dynamic shapes: per layer the active tokens, per subset the padded width
            assert set(got["engine"]) <= {"early exit: active tokens", "early exit: padded width"}, got
            assert got["engine"].get("early exit: active tokens", 0) > 0
        else:
            assert got["engine"] == {}, (rank, got["engine"])
        step = {k: v for k, v in got["step"].items() if not k.startswith("early exit")}
        expected = {"pipeline step sums": 1}
        if scheme in MOE:
            expected["routing statistics"] = 1
        if scheme == "moe":
            expected["moe scheme: expert counts"] = 1
        if scheme == CURRICULUM:
            expected["curriculum rows"] = 1
        if scheme == COVERAGE:  # every layer's measured shares in one read
            expected["sparse attention: coverage"] = 1
        if scheme == "freezing":  # the audited step 4 is a check (every 2 steps): every layer's sums in one read
            expected["freezing: plasticity"] = 1
        assert step == expected, (rank, got["step"])
