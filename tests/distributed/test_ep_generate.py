"""Text generation with expert parallelism (moebal/distributed/ep_generate.py) on gloo ranks: every policy gives
each prompt the single-process decoder's tokens, greedy and sampled, with the KV cache and without it, while ranks
stop at different steps; skewed routing gets replicas."""

from __future__ import annotations

import pytest

from moebal.distributed.ep_generate import expert_parallel_generate, share
from moebal.models.generate import Sampling, generate_many
from tests.distributed.test_lina_inference import _model, _profile

PROMPTS = [[5, 17, 200, 3], [9], [44, 12, 12, 90, 7, 61, 2], [130, 131], [77, 3, 18]]


def test_share_cuts_a_batch_into_contiguous_shares_of_one_length() -> None:
    assert [share(5, 2, r) for r in range(2)] == [([0, 1, 2], 3), ([3, 4], 3)]
    assert [share(2, 3, r) for r in range(3)] == [([0], 1), ([1], 1), ([], 1)]
    assert [share(3, 4, r)[0] for r in range(4)] == [[0], [1], [2], []]


def test_every_policy_generates_the_single_process_tokens_on_two_ranks() -> None:
    """5 prompts on 2 ranks in batches of 2 (a prompt a rank, then the fifth beside a dummy), top-2 routing skewed
    to one hot expert per layer. The third prompt (rank 0 in the second batch) reaches a stop token its neighbour
    does not: rank 0 has nothing left to decode while rank 1 goes on, so rank 0 must go on with it (without the
    lockstep it leaves the forwards rank 1 waits in); every row ends where it ends alone. (8 experts on
    2 ranks fill both, at most 4 experts a rank: the mappings move experts between the ranks, without replicas.
    The policies plan at `min_rows` 0: at the default no forward here fills a MIN_ROWS group, and every policy
    would run the static blocks, tests/distributed/test_lina_inference.py.)"""
    model = _model(2)
    alone = generate_many(model, PROMPTS, 8)
    stop = alone[2].tokens[3]  # the third prompt's fourth token
    want = generate_many(model, PROMPTS, 8, stop_ids=[stop])
    assert want[2].stop == "stop_token" and want[3].stop == "length" and len(want[2].tokens) < 8
    got = expert_parallel_generate(model, PROMPTS, 2, 8, batch_size=2, stop_ids=[stop],
                                   policies=["static", "lina", "phase1", "oracle"], profile=_profile(model),
                                   timeout_s=60, min_rows=0)
    for policy, res in got.items():
        assert [g.tokens for g in res.generations] == [g.tokens for g in want], policy
        assert [g.stop for g in res.generations] == [g.stop for g in want], policy
        assert [g.prompt for g in res.generations] == PROMPTS
        assert len(res.moe_s) > 0 and all(t > 0 for t in res.moe_s)
        # the slowest rank's parts of each forward are disjoint spans of its MoE time
        assert all(0 < p["experts_s"] + p["plan_s"] + p["exchange_s"] <= p["seconds"] for p in res.parts)
        # per forward, the first MoE layer's rows over both ranks (top-2): each batch's prompts' forward (4 + 1,
        # 7 + 2, 3 + the dummy's 1 tokens), then its decode steps at one token a rank
        prompts = [i for i, rows in enumerate(res.rows) if rows != 2 * 2]
        assert [res.rows[i] for i in prompts] == [2 * 5, 2 * 9, 2 * 4] and prompts[0] == 0, (policy, res.rows)
        assert len(res.rows) == len(res.moe_s)
    assert got["static"].replans == 0 and got["oracle"].replans == 4 * len(got["oracle"].moe_s)  # 4 MoE layers


def test_sampled_and_whole_prefix_generation_on_two_ranks_equal_one_process() -> None:
    """Seeded sampling (top-p) draws each row from its own generator, so a row's tokens do not depend on its rank;
    the whole-prefix path (cache=False, a scheme without a cached form) runs its prompts one by one in lockstep."""
    model = _model(1)
    s = Sampling(temperature=0.9, top_p=0.9, seed=3)
    sampled = expert_parallel_generate(model, PROMPTS, 2, 6, s, batch_size=8, timeout_s=60)["static"]
    assert [g.tokens for g in sampled.generations] == [g.tokens for g in generate_many(model, PROMPTS, 6, s)]
    whole = expert_parallel_generate(model, PROMPTS[:3], 2, 5, cache=False, policies=["oracle"], timeout_s=60)["oracle"]
    assert [g.tokens for g in whole.generations] == [g.tokens for g in generate_many(model, PROMPTS[:3], 5,
                                                                                      cache=False)]


def test_a_model_whose_experts_the_ranks_cannot_share_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match="8 experts cannot be spread evenly over 3 ranks"):
        expert_parallel_generate(_model(1), PROMPTS, 3, 4)


def test_a_rank_whose_tokens_all_skip_a_layer_still_joins_its_exchanges() -> None:
    """One prompt a rank, KV-cached, through schemes where a decoded token may skip a layer: early exit (about half
    the tokens leave after layer 1 at this threshold) and Mixture-of-Depths routed by its causal predictors (about
    half run each routed layer), the latter also by the whole prefix's forward. A rank whose only token skips an
    MoE layer must still take its part in the layer's exchanges, with no rows, or the other rank waits there; the
    tokens equal one process's."""
    from tests.unit.test_generate import _early_exit_model
    from tests.unit.test_mod_predictor import _served

    prompts = [[5, 17, 200, 3, 9, 44], [130, 131, 12, 90, 7, 61]]
    runs = ((_early_exit_model(0.996), prompts, True), (_served(experts=4), prompts, True),
            (_served(experts=4), [[5], [131]], False))  # one-token prompts: a whole prefix can skip a layer
    for model, these, cache in runs:
        want = [g.tokens for g in generate_many(model, these, 8, cache=cache)]
        got = expert_parallel_generate(model, these, 2, 8, batch_size=2, cache=cache, timeout_s=60)["static"]
        assert [g.tokens for g in got.generations] == want, cache
