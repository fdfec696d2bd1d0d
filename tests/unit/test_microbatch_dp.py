"""The micro-batch DP's fast paths against plain references: the cost table's grid query against its scalar
queries, the per-length run tables against per-sample ones, the blocked DP against a loop over every run, and
`dp_split` with the blocked DP against `dp_split` with that loop (the same plans, bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest

import moebal.planner.microbatch as mb
from moebal.planner.adaptive_schedule import one_f_one_b, simulate
from moebal.planner.instructions import build_comm_plan, check_plan
from moebal.planner.microbatch_cost import MicroBatchCost, default_grid


def rand_table(rng: np.random.Generator, P: int, max_len: int, max_tokens: int, noise: float,
               holes: float) -> MicroBatchCost:
    """A ragged table: t = a + b x tokens + c x tokens x s with noise (not monotone where noisy), memory ~ tokens,
    absent points beyond a token cap and, with `holes`, at random."""
    b, s = default_grid(max_len, max_tokens)
    rows, seq = np.meshgrid(b, s, indexing="ij")
    tok = rows * seq
    t = rng.uniform(0.05, 0.5) + rng.uniform(1e-4, 2e-3) * tok + rng.uniform(0, 4e-6) * tok * seq
    t = np.broadcast_to(t, (P,) + t.shape) * np.exp(noise * rng.standard_normal((P,) + t.shape))
    act = np.broadcast_to(tok.astype(float), t.shape) * np.exp(0.1 * rng.standard_normal(t.shape))
    absent = (tok > max_tokens * rng.uniform(0.5, 1.0)) | (rng.random(tok.shape) < holes)
    t, act = np.where(absent, np.nan, t), np.where(absent, np.nan, act)
    return MicroBatchCost(b_grid=b, s_grid=s, fwd_PBS=t / 3, bwd_PBS=2 * t / 3, act_PBS=act, source="random")


def plain_dp(E: np.ndarray, tmax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq2 as written, one limit, one prefix end, one run at a time; the shortest last run among equal sums."""
    N, K = E.shape
    f = np.full((tmax.size, N + 1), np.inf)
    f[:, 0] = 0.0
    arg = np.zeros((tmax.size, N + 1), dtype=np.int64)
    for c, lim in enumerate(tmax.tolist()):
        for n in range(1, N + 1):
            for k in range(1, min(K, n) + 1):
                t = E[n - 1, k - 1]
                if t <= lim and f[c, n - k] + t < f[c, n]:
                    f[c, n], arg[c, n] = f[c, n - k] + t, n - k
    return f, arg


def plain_thin(vals: np.ndarray, delta: float) -> np.ndarray:
    """The thinning loop as first written: each window [v, v + delta] kept as its upper end."""
    keep, i = [], 0
    while i < vals.size:
        j = int(np.searchsorted(vals, vals[i] + delta, side="right")) - 1
        keep.append(vals[j])
        i = j + 1
    return np.asarray(keep)


def test_a_grid_query_equals_its_scalar_queries():
    rng = np.random.default_rng(0)
    for spread in (1, 2, 3):
        cost = rand_table(rng, 3, 256, 2048, 0.3, 0.1).spread_over(spread)
        k, s = np.arange(1, 70), np.asarray([1, 5, 16, 17, 40, 64, 100, 128, 200, 256, 300])
        grid_t, grid_m = cost.time(k[None, :], s[:, None]), cost.memory(k[None, :], s[:, None])
        assert np.array_equal(grid_t, [[float(cost.time(int(kk), int(ss))) for kk in k] for ss in s])
        assert np.array_equal(grid_m, [[float(cost.memory(int(kk), int(ss))) for kk in k] for ss in s])
        assert np.isfinite(grid_t).any() and np.isinf(grid_t).any()


@pytest.mark.parametrize("memory", [False, True])
def test_the_run_tables_equal_the_per_sample_tables(memory):
    # the DP's tables by distinct padded length and by end index, and its candidate limits, against the
    # plain per-sample table: run (i, k) costs cost.time(k, padded length of sample i), inf past the batch's end
    rng = np.random.default_rng(1)
    for _ in range(12):
        cost = rand_table(rng, 2, 256, 256 * int(rng.choice([2, 8])), 0.2, 0.05)
        N = int(rng.integers(1, 60))
        L = np.sort(np.clip(rng.lognormal(np.log(40), 1.0, N), 1, 256).astype(int))[::-1]
        pad = int(rng.choice([1, 8]))
        runs = mb._run_tables(L, cost, pad, memory)
        limit = float(rng.uniform(50, 2000)) if memory else None
        tt = mb._allowed(runs, limit)
        K = tt.shape[1]
        per_sample = np.full((N, K), np.inf)
        for i in range(N):  # sample i's runs: one query per sample (a grid query equals its scalar ones, above)
            k = np.arange(1, min(K, N - i) + 1)
            t, m = cost.time(k, int(mb._pad(L[i], pad))), cost.memory(k, int(mb._pad(L[i], pad)))
            per_sample[i, :k.size] = np.where(np.isfinite(t) & (limit is None or m <= limit), t, np.inf)
        for i in range(N):  # a run's row of its length group, as far as the batch reaches from sample i
            assert np.array_equal(tt[runs.grp[i], :N - i], per_sample[i, :N - i])
        assert np.array_equal(np.unique(tt[np.isfinite(tt)]), np.unique(per_sample[np.isfinite(per_sample)]))
        ends = mb._ends(tt, runs.grp)
        for n in range(1, N + 1):
            row = [per_sample[n - k, k - 1] if k <= n else np.inf for k in range(1, K + 1)]
            assert np.array_equal(ends.E[n - 1], row)
            assert np.array_equal(ends.S[n - 1], [min(row[k:]) for k in range(K)])
            assert np.array_equal(ends.P[n - 1], [max(row[:k + 1]) for k in range(K)])
        vals = np.unique(per_sample[np.isfinite(per_sample)])
        for delta in (0.0, 0.01, 0.3, 5.0):
            assert np.array_equal(mb._thin(vals, delta), vals if delta == 0 else plain_thin(vals, delta))


def test_the_blocked_dp_equals_the_plain_loop(monkeypatch):
    # the same sums bit for bit and the same argmin (the shortest last run among equal sums) wherever a prefix
    # has a split, for every grouping of the limits into blocks: ties come from a few distinct run times
    rng = np.random.default_rng(2)
    for trial in range(150):
        N, G = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        K = int(rng.integers(1, N + 1))
        tt = rng.choice([0.5, 1.0, 1.5, 2.0, 3.0], size=(G, K)) if trial % 2 else 3 * rng.random((G, K))
        tt[rng.random((G, K)) < 0.2] = np.inf
        grp = np.sort(rng.integers(0, G, N))
        finite = np.unique(tt[np.isfinite(tt)])
        tmax = rng.choice(finite if finite.size else np.ones(1), size=int(rng.integers(1, 12)))
        monkeypatch.setattr(mb, "DP_STEP_S", float(rng.choice([0.0, 20e-6, 1.0])))  # many, some, one block
        ends = mb._ends(tt, grp)
        f, arg = mb._dp(ends, tmax)
        f_ref, arg_ref = plain_dp(ends.E, tmax)
        assert np.array_equal(f, f_ref), trial
        assert np.array_equal(arg[np.isfinite(f_ref)], arg_ref[np.isfinite(f_ref)]), trial


def test_dp_split_with_the_blocked_dp_plans_what_the_plain_loop_plans(monkeypatch):
    # end to end, randomised: memory modes, data parallelism (with the replicas' repair), lockstep ranks, thinning,
    # noisy (non-monotone) tables with holes, ties among equal lengths; every field of the result the same
    rng = np.random.default_rng(3)
    fast_dp = mb._dp
    rounds = 0
    for trial in range(80):
        large = trial % 10 == 9  # 150 samples of many lengths, runs of at most 32: more limits than a round
        P = int(rng.choice([2, 4] if large else [1, 2, 4]))
        cost = rand_table(rng, P, 128, 512 if large else 128 * int(rng.choice([2, 8])), float(rng.choice([0.0, 0.3])),
                          0.0 if large else float(rng.choice([0.0, 0.05])))
        cost = cost.spread_over(1 if large else int(rng.choice([1, 1, 2])))
        N = 150 if large else int(rng.integers(cost.spread, 45))
        L = np.sort(np.clip(rng.lognormal(np.log(25), 1.0, N), 1, 128).astype(int))[::-1]
        if trial % 5 == 0:
            L[:] = L[0]
        kw = {"dp": int(rng.choice([1, 2, 3])), "thin": float(rng.choice([0.0, 0.001] if large else [0.0, 0.01, 0.05])),
              "memory": float(rng.uniform(0.3, 3) * 128 * P) if trial % 3 == 0 else None,
              "pad_multiple": 1 if large else int(rng.choice([1, 8]))}
        results = []
        for dp_impl in (fast_dp, lambda ends, tmax: plain_dp(ends.E, tmax)):
            monkeypatch.setattr(mb, "_dp", dp_impl)
            try:
                results.append(mb.dp_split(L, cost, P, **kw))
            except mb.ConfigError as e:
                results.append(str(e))
        assert results[0] == results[1], (trial, results)
        rounds += not isinstance(results[0], str) and results[0].candidates > 2 * mb.SEARCH_GRID
    assert rounds >= 3


def test_a_send_without_its_receive_is_named():
    # the checker's set of each stage's instructions is built once per stage: it still finds an unmatched send
    streams = build_comm_plan(simulate(one_f_one_b(2, [0, 1]), np.ones((2, 2)), np.ones((2, 2))).ops, 2)
    assert check_plan(streams)
    broken = [list(s) for s in streams]
    broken[1].remove(("recv_act", 1))
    assert "stage 0: act 1 is sent to stage 1 without a matching receive" in check_plan(broken).reason
