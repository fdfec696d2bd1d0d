"""scripts/bench_lina_decode.py: a round times each policy's prompts' forward apart from its decode steps, and the
summary keeps every round, compares with static and catches a policy whose tokens differ."""

from __future__ import annotations

import copy

from tests.cli_util import load_script
from tests.distributed.test_lina_inference import _model, _profile

PROMPTS = [[5, 17, 200, 3], [9, 9, 9, 9], [44, 12, 12, 90], [130, 131, 7, 7]]


def test_a_round_splits_the_prompts_forward_from_the_decode_steps_and_the_summary_compares_with_static() -> None:
    script = load_script("bench_lina_decode")
    model = _model(2)
    order = ["lina", "phase1", "oracle", "static"]  # static need not run first
    one = script.decode_round(model, PROMPTS, 2, 4, order, _profile(model))
    assert set(one) == set(order)
    for policy, r in one.items():
        # 4 new tokens: the prompts' forward gives the first, 3 decode steps the rest
        assert r["decode_steps"] == 3 and r["decode_moe_s"] > 0 and r["prompt_moe_s"] > 0, policy
        assert r["tokens"] == one["static"]["tokens"] and all(len(t) == 4 for t in r["tokens"]), policy
        parts = r["decode_parts_s"]  # the slowest rank's experts, planning and exchanges: each took time
        assert set(parts) == set(script.LAYER_PARTS) and parts["experts_s"] > 0 and parts["exchange_s"] > 0, parts
    two = copy.deepcopy(one)
    two["static"]["decode_moe_s"] *= 2  # a second round: static twice as slow while decoding
    summ = script.summarise([one, two])
    assert summ["static"]["decode_moe_s"] == [one["static"]["decode_moe_s"], two["static"]["decode_moe_s"]]
    assert summ["static"]["static_over_this_decode"] == 1.0 and all(summ[p]["equal_static"] for p in order)
    assert summ["lina"]["decode_parts_s_median"] == one["lina"]["decode_parts_s"]  # two equal rounds: their median
    assert summ["lina"]["static_over_this_decode"] == (1.5 * one["static"]["decode_moe_s"]
                                                       / one["lina"]["decode_moe_s"])
    two["oracle"]["tokens"][0][0] += 1
    assert not script.summarise([one, two])["oracle"]["equal_static"]
    # top-1 (on 2 ranks a top-2 expert is never more than one rank's worth, so never replicated): no expert of
    # these batches (16 rows in a prompts' forward, 4 a step) fills two groups of MIN_ROWS, so no replicas at the
    # default; the thesis's allocation (min_rows 0) replicates the skewed layers' hot experts
    top1 = _model(1)
    for min_rows, replicated in ((64, False), (0, True)):
        r = script.decode_round(top1, PROMPTS, 2, 4, ["static", "oracle"], None, min_rows=min_rows)
        assert (r["oracle"]["replicas"] > 0) == replicated and r["oracle"]["tokens"] == r["static"]["tokens"], r
