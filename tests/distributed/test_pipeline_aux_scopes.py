"""`moe.aux_loss_scope` on the pipeline engine against the single-process model: `pooled` (one balancing loss over
the layers of every stage, its totals exchanged beside the activations and gradients) and `sequence` (each rank's
rows' own): on 2 stages, parameters after 4 AdamW steps; on 2 stages x 2 data-parallel (or expert-parallel) ranks
under 1F1B and zero bubble with a migration, the losses and logged auxiliary losses, and the migration and
schedule changing nothing; planned micro-batches (variable sizes, padding); a frozen prefix (no totals cross a
boundary no gradient crosses)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moebal.config import Config
from moebal.distributed.testing import run_ranks
from tests.distributed import test_microbatching as mb
from tests.distributed.test_pipeline import SCHEMES, _merge, _train, reference_losses, tiny

STEPS = 4


def _scoped(cfg: Config, scope: str, ep: int | None = 1) -> Config:
    moe = dataclasses.replace(cfg.moe, aux_loss_coef=0.5, aux_loss_scope=scope)
    return dataclasses.replace(cfg, moe=moe, parallel=dataclasses.replace(cfg.parallel, ep=ep))


def _cfg(scope: str, nproc: int, ep: int = 1) -> Config:
    return _scoped(tiny(n_layers=4, pp=2, moe=4, nproc=nproc), scope, ep)


def _planned(scope: str) -> Config:
    return _scoped(mb.docs(moe=4), scope)


def _two_ranks(rank: int, world: int, path: str) -> dict:
    torch.set_num_threads(1)
    mb.SAMPLES["path"] = path
    six = _scoped(tiny(n_layers=6, pp=2, moe=4), "pooled")
    return {"pooled": _train(_cfg("pooled", 2), STEPS, micro_batches=2),
            "sequence": _train(_cfg("sequence", 2), STEPS, micro_batches=2),
            "pooled_planned": mb._train(_planned("pooled"), 3),
            "sequence_planned": mb._train(_planned("sequence"), 3),
            # layers freeze from the front: the first stage's output then needs no gradient, nor the totals
            "pooled_freezing": _train(six, 6, "freezing", micro_batches=2),
            "pooled_freezing_forced": _train(six, 6, "freezing", micro_batches=2, force=((2, (2, 4)),))}


def _four_ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {}
    for name, run in {
        "pooled_1f1b": lambda: _train(_cfg("pooled", 4), STEPS, micro_batches=2),
        "pooled_zb_forced": lambda: _train(_cfg("pooled", 4), STEPS, micro_batches=2, schedule="zb",
                                           force=((2, (1, 3)),)),
        "sequence_1f1b": lambda: _train(_cfg("sequence", 4), STEPS, micro_batches=2),
        "pooled_ep": lambda: _train(_cfg("pooled", 4, ep=2), STEPS, micro_batches=2),  # experts sharded
    }.items():
        out[name] = run()
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    path = mb.write_samples(str(tmp_path_factory.mktemp("samples") / "samples.jsonl"))
    mb.SAMPLES["path"] = path
    return run_ranks(_two_ranks, 2, path, timeout_s=600)


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_ranks(_four_ranks, 4, timeout_s=600)


def _reference(scope: str, nproc: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    aux: list[float] = []
    losses, state = reference_losses(_cfg(scope, nproc), STEPS, micro=2, aux=aux)
    assert aux[0] > 0.5  # the balancing loss is there, and weighs (coefficient 0.5)
    return losses, aux, state


def _close(got: list[float], want: list[float], rel: float = 2e-6) -> bool:
    return len(got) == len(want) and all(math.isclose(a, b, rel_tol=rel) for a, b in zip(got, want))


@pytest.mark.parametrize("scope", ["pooled", "sequence"])
def test_scopes_on_two_stages_equal_the_single_process_model(two, scope):
    ref, aux, state = _reference(scope, 2)
    for r in two:
        rec = r[scope]["records"]
        assert _close([x["loss"] for x in rec], ref), (scope, rec, ref)
        assert _close([x["aux_loss"] for x in rec], aux), (scope, [x["aux_loss"] for x in rec], aux)
    got = _merge([r[scope]["state"] for r in two])
    for k, v in state.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=f"{scope}: {k}")


@pytest.mark.parametrize("case", ["pooled_1f1b", "sequence_1f1b", "pooled_ep"])
def test_scopes_with_data_and_expert_parallel_stages(four, case):
    """Losses and logged auxiliary losses (the mean over a stage's ranks for `sequence`); parameters are checked
    on two stages above (AdamW makes the summation order's last bits visible after a few steps here)."""
    ref, aux, _ = _reference(case.split("_")[0], 4)
    for r in four:
        rec = r[case]["records"]
        assert _close([x["loss"] for x in rec], ref), (case, rec, ref)
        assert _close([x["aux_loss"] for x in rec], aux), (case, [x["aux_loss"] for x in rec], aux)
    # zero bubble and a migration move work, not the maths: the same losses, bit for bit
    for r in four:
        assert [x["loss"] for x in r["pooled_zb_forced"]["records"]] == [x["loss"] for x in r["pooled_1f1b"]["records"]]
        assert [x["aux_loss"] for x in r["pooled_zb_forced"]["records"]] == \
            [x["aux_loss"] for x in r["pooled_1f1b"]["records"]]
        assert r["pooled_zb_forced"]["sizes"] == [1, 3]


@pytest.mark.parametrize("scope", ["pooled", "sequence"])
def test_scopes_on_planned_micro_batches(two, scope):
    run = two[0][f"{scope}_planned"]
    ref = mb.planned_reference(_planned(scope), run["plans"])
    assert ref["aux"][0] > 0.1
    assert _close(run["losses"], ref["losses"], 1e-5), (run["losses"], ref["losses"])
    assert _close(run["aux"], ref["aux"], 1e-5), (run["aux"], ref["aux"])
    grads = _merge([r[f"{scope}_planned"]["grads"] for r in two])
    for k, v in ref["grads"].items():
        torch.testing.assert_close(grads[k], v, rtol=1e-4, atol=1e-6 * float(v.abs().max()), msg=f"{scope}: {k}")


def test_pooled_with_a_frozen_prefix(two):
    """Freezing stops gradients at the boundary; the totals go back only where a gradient goes. The run
    trains, freezes, and a migration under it changes nothing."""
    static, forced = two[0]["pooled_freezing"], two[0]["pooled_freezing_forced"]
    assert any(x.get("frozen_layers", 0) or x.get("frozen", 0) for x in static["records"]), static["records"][-1]
    assert forced["losses"] == static["losses"]
    assert [x["aux_loss"] for x in forced["records"]] == [x["aux_loss"] for x in static["records"]]
    assert all(math.isfinite(x["aux_loss"]) and x["aux_loss"] > 0 for x in static["records"])
    assert SCHEMES["freezing"]  # the scheme's options come from the pipeline tests
