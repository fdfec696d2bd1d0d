"""Split partition units (`pipeline.split_layers`) on real gloo ranks: a stage boundary inside a layer changes
no number.

Each run trains the tiny model of test_pipeline.py. With split units, forced migrations that cut layers
between their attention and FFN halves (and move halves with gradients and AdamW state) must give exactly
the losses and parameters of the static split run. The static split run matches the whole-layer run up to
the order in which the gradient norm adds its per-slot sums.
"""

from __future__ import annotations

import math

import pytest
import torch

from moebal.distributed.testing import run_ranks
from tests.distributed.test_pipeline import _merge, _train, tiny

MOD = {"capacity": 0.5, "every": 2, "first_layer": 1}  # layers 1, 3, 5 routed (whole); 0, 2, 4 split


def _two_ranks(rank: int, world: int) -> dict:
    six = tiny(n_layers=6, pp=world)
    # six split layers: 12 units, [6, 6] at the start; 5 = layers 0-1 and layer 2's attention half
    cut = ((1, (5, 7)), (2, (3, 9)), (3, (8, 4)))
    mod_cut = ((2, (4, 5)), (4, (6, 3)))  # units 0a 0f 1 2a | 2f 3 4a 4f 5, then 0a .. 3 | 4a 4f 5
    plan = {"rebalance": "partition", "every": 2, "bandwidth": 1e15, "latency": 0.0, "min_gain": 0.0}
    return {
        "whole": _train(six, 5, micro_batches=4),
        "split": _train(six, 5, micro_batches=4, split_layers=True),
        "split_forced": _train(six, 5, micro_batches=4, split_layers=True, force=cut),
        "split_mid": _train(six, 5, micro_batches=4, split_layers=True, force_mid=((2, (7, 5)),),
                            force=((3, (6, 6)),)),
        "split_zb": _train(six, 5, micro_batches=4, split_layers=True, schedule="zb", force=cut),
        "mod": _train(six, 6, "mod", MOD, micro_batches=2, split_layers=True),
        "mod_forced": _train(six, 6, "mod", MOD, micro_batches=2, split_layers=True, force=mod_cut),
        # a forced lopsided partition (layer 0's halves alone on the first stage) that the planner must undo
        "mod_planned": _train(six, 6, "mod", MOD, micro_batches=2, split_layers=True, force=((1, (2, 7)),), **plan),
        "m2": _train(six, 6, micro_batches=2, split_layers=True),
        # a forced lopsided partition (layer 0 alone on the first stage) that the planner must undo
        "m2_planned": _train(six, 6, micro_batches=2, split_layers=True, force=((1, (2, 10)),), **plan),
        "freezing": _train(six, 4, "freezing", None, micro_batches=2, split_layers=True),
    }


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_ranks(_two_ranks, 2)


def test_split_units_match_whole_layers(two):
    whole, split = two[0]["whole"], two[0]["split"]
    assert split["sizes"] == [6, 6]  # every layer in two halves; the start keeps layers whole
    for a, b in zip(whole["losses"], split["losses"]):
        assert math.isclose(a, b, rel_tol=1e-6)
    w = _merge([r["whole"]["state"] for r in two])
    s = _merge([r["split"]["state"] for r in two])
    assert set(w) == set(s)  # a half-held layer keeps the model's parameter names
    for k in w:
        torch.testing.assert_close(s[k], w[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("run", ["split_forced", "split_mid", "split_zb"])
def test_moving_layer_halves_changes_nothing(two, run):
    assert two[0][run]["losses"] == two[0]["split"]["losses"]
    moved = [r for r in two[0][run]["records"] if r.get("migration")]
    assert moved and all(r["layers_moved"] > 0 for r in moved)
    static = _merge([r["split"]["state"] for r in two])
    got = _merge([r[run]["state"] for r in two])
    assert set(got) == set(static)
    for k in static:
        assert torch.equal(got[k], static[k]), k


def test_forced_sizes_cut_inside_layers(two):
    # the last forced partition of "split_forced" is (8, 4): layers 0-3 and layers 4-5 ...
    assert two[0]["split_forced"]["sizes"] == [8, 4]
    # ... and (5, 7) before it put layer 2's halves on different ranks
    sizes = [r["sizes_after"] for r in two[0]["split_forced"]["records"] if r.get("migration")]
    assert sizes[0] == [5, 7]


def test_mixture_of_depths_keeps_routed_blocks_whole_and_its_losses(two):
    mod = two[0]["mod"]
    assert mod["sizes"] == [5, 4]  # 0a 0f 1 2a 2f | 3 4a 4f 5
    assert two[0]["mod_forced"]["losses"] == mod["losses"]
    assert two[0]["mod_planned"]["losses"] == mod["losses"]
    assert any(r.get("migration") == "partition" for r in two[0]["mod_planned"]["records"])  # the planner moved
    assert two[0]["mod_forced"]["sizes"] == [6, 3]


def test_planned_rebalancing_over_units_keeps_the_losses(two):
    planned = two[0]["m2_planned"]
    assert any(r.get("migration") == "partition" for r in planned["records"])  # the planner moved units
    assert planned["losses"] == two[0]["m2"]["losses"]


def test_schemes_with_layer_state_keep_whole_layers(two):
    assert two[0]["freezing"]["sizes"] == [3, 3]  # freezing keeps per-layer snapshots: nothing splits
