"""Adaptive Gating's curriculum (`data.order: complexity`): the order, the sampler and the trainer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moebal.config import with_overrides
from moebal.data.curriculum import Curriculum, complexity_order
from moebal.errors import ConfigError
from moebal.train import Trainer
from tests.unit.test_train import tiny


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_anchor_first_then_by_cosine_similarity_and_unseen_samples_last():
    rng = np.random.default_rng(0)
    ids = np.array([5, 2, 9, 0, 7, 3])
    C = rng.uniform(0.05, 0.9, size=(6, 3))
    tokens = np.array([32, 32, 32, 10, 32, 32], dtype=np.float64)
    C[3] = [0.9, 0.9, 0.9]  # the highest shares, but of 10 tokens: 27 two-expert tokens
    C[1] = [0.3, 0.3, 0.3]  # 28.8: the fewest is sample 0 (the short one)
    fallback = rng.permutation(12)
    by_id = dict(zip(ids.tolist(), C))
    unseen = [i for i in fallback.tolist() if i not in ids]
    for metric, sim in (("cosine", lambda c: _cos(c, by_id[0])), ("distance", lambda c: -np.linalg.norm(c - by_id[0]))):
        order = complexity_order(ids, C, tokens, fallback, metric)
        assert sorted(order.tolist()) == list(range(12))  # a permutation of the epoch
        assert order[0] == 0
        sims = [sim(by_id[i]) for i in order[1:6]]
        assert all(a >= b for a, b in zip(sims, sims[1:])), (metric, sims)
        assert order[6:].tolist() == unseen  # in their shuffled order


def test_a_zero_anchor_orders_by_norm_and_ties_keep_the_shuffled_order():
    ids = np.array([1, 2, 3, 4])
    C = np.array([[0.0, 0.0], [0.2, 0.2], [0.1, 0.0], [0.2, 0.2]])
    for metric in ("cosine", "distance"):  # a zero anchor: both by the norm
        order = complexity_order(ids, C, np.full(4, 8.0), np.array([4, 3, 2, 1, 0]), metric)
        assert order.tolist() == [1, 3, 4, 2, 0]  # anchor, smallest norm, the tie (4 before 2 as shuffled), unseen
    with pytest.raises(ValueError, match="distance, cosine"):
        complexity_order(ids, C, np.full(4, 8.0), np.arange(5), "manhattan")


def _spread(C: np.ndarray, order: np.ndarray, B: int = 8) -> float:
    """Mean over batches of consecutive samples of the std of their two-expert shares (all layers)."""
    share = C[order].mean(axis=1)
    return float(np.mean([share[i:i + B].std() for i in range(0, len(order), B)]))


def test_batches_of_the_curriculum_are_more_homogeneous_than_shuffled_ones():
    """The extraction's check: the spread of two-expert shares within a batch goes down. Samples at different
    levels of one profile (a hard sample takes two experts more often in every layer): the distance orders
    them; the cosine sees one direction and cannot (the reason distance is the default)."""
    rng = np.random.default_rng(1)
    n, L = 256, 4
    profile = np.array([0.4, 0.7, 1.0, 0.8])
    C = np.clip(rng.uniform(0.0, 0.6, size=(n, 1)) * profile + rng.normal(0, 0.01, (n, L)), 0, 1)
    shuffled = rng.permutation(n)
    by_distance = complexity_order(np.arange(n), C, np.full(n, 32.0), shuffled, "distance")
    by_cosine = complexity_order(np.arange(n), C, np.full(n, 32.0), shuffled, "cosine")
    assert _spread(C, by_distance) < 0.2 * _spread(C, shuffled)
    assert _spread(C, by_cosine) > 0.5 * _spread(C, shuffled)
    # profiles that differ in shape (hard samples take two experts in the late layers): both metrics group them
    late = rng.random(n) < 0.5
    C2 = np.where(late[:, None], [0.05, 0.05, 0.6, 0.6], [0.3, 0.3, 0.05, 0.05]) + rng.normal(0, 0.01, (n, L))
    for metric in ("distance", "cosine"):
        order = complexity_order(np.arange(n), np.clip(C2, 0, 1), np.full(n, 32.0), shuffled, metric)
        assert _spread(C2, order) < 0.2 * _spread(C2, shuffled), metric


def test_entries_recorded_after_an_epoch_began_do_not_order_it():
    cur = Curriculum()
    cur.record([0, 1], np.array([[0.5], [0.1]]), [8, 8], at=10)
    cur.record([0], np.array([[0.0]]), [8], at=25)  # the batch that crossed into the epoch starting at 20
    fallback = np.array([1, 0, 2])
    assert cur.order(fallback, upto=20).tolist() == [1, 0, 2]  # sample 0 by its entry at 10
    assert cur.order(fallback, upto=30).tolist() == [0, 1, 2]  # now its newest: no two-expert token
    back = Curriculum()
    back.load_state_dict(json.loads(json.dumps(cur.state_dict())))
    assert back.order(fallback, upto=20).tolist() == [1, 0, 2] and back.table == cur.table


def test_sample_complexity_by_hand_and_equal_to_row_complexity_for_one_sample_rows():
    """Per sample of a packed and a padded row: its real tokens' share of two-expert tokens per layer."""
    import types

    import torch

    from moebal.data.curriculum import row_complexity, sample_complexity

    # 2 rows x 4 positions: row 0 packs samples 0 (3 tokens) and 1 (1 token); row 1 holds sample 2 (2 tokens) and
    # 2 positions of padding; one layer, top-2 with adaptive gating: `taken` marks which choices were kept
    two = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1]], dtype=torch.bool).reshape(-1)
    taken = torch.stack([torch.ones(8, dtype=torch.bool), two], dim=1)
    layer = types.SimpleNamespace(last_routing=types.SimpleNamespace(taken_TK=taken), top_k=2)
    seg = torch.tensor([[0, 0, 0, 1], [2, 2, -1, -1]])
    got = sample_complexity([layer], seg, 3)
    assert got[:, 0].tolist() == pytest.approx([2 / 3, 1.0, 0.5])
    # one sample per row (padding after it): what row_complexity gives from the labels
    labels = torch.tensor([[5, 5, 5, 5], [5, 5, -100, -100]])
    rows = torch.tensor([[0, 0, 0, 0], [1, 1, -1, -1]])
    assert torch.equal(sample_complexity([layer], rows, 2), row_complexity([layer], labels))


def test_a_lag_orders_an_epoch_from_entries_before_its_last_batches_and_keeps_enough_entries():
    """`set_curriculum_lag`: the sampler orders epoch 1 from the entries recorded up to N - lag, and a sample
    keeps one more entry per epoch the lag reaches back."""
    from moebal.data import build_data

    sampler = build_data(with_overrides(tiny(*CUR), ["data.batch_size=4"])).train
    N = sampler.state_dict()["samples"]
    cur = sampler.curriculum
    cur.record([0, 1], np.array([[0.5], [0.3]]), [8, 8], at=4)
    cur.record([0], np.array([[0.0]]), [8], at=N - 4)  # inside the last 8 samples before epoch 1
    sampler.set_curriculum_lag(8)
    assert cur.keep == 3
    while sampler.epoch == 0:
        sampler.next_sample()
    sampler.next_samples()  # the first batch of epoch 1, ordered when its first sample was drawn
    assert sampler.last_ids[:2] == [1, 0]  # sample 0 by its entry at 4: sample 1 has fewer two-expert tokens
    assert cur.order(np.arange(N), upto=N)[:2].tolist() == [0, 1]  # without the lag: its entry at N - 4
    sampler.set_curriculum_lag(N + 1)
    assert cur.keep == 4


def _table_upto(cur: Curriculum, upto: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = [(i, e[1], e[2]) for i, es in cur.table.items() for e in es if e[0] <= upto]
    return (np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), np.array([r[2] for r in rows], float))


CUR = ["moe.adaptive_threshold=0.02", "data.order=complexity", "data.max_bytes=2500", "data.batch_size=8",
       "data.val_fraction=0.0", "train.eval_every=0"]


def test_the_trainer_orders_the_second_epoch_by_the_first_and_resumes_bit_for_bit(tmp_path):
    cfg = tiny(*CUR, "train.steps=14")
    whole = Trainer(cfg, tmp_path / "whole")
    sampler = whole.data.train
    per_epoch = sampler._num_samples()
    assert 8 < per_epoch < 14 * 8 - 16, per_epoch  # the run crosses into the second epoch
    while sampler._order_epoch < 1:  # train into the second epoch
        whole.train_step()
    rng = np.random.default_rng([sampler.seed, 1])  # the sampler's shuffle of the epoch: offset, then order
    rng.integers(sampler.seq_len)
    fallback = rng.permutation(per_epoch)
    expect = complexity_order(*_table_upto(sampler.curriculum, per_epoch), fallback)
    assert sampler._order.tolist() == expect.tolist()
    assert sampler._order.tolist() != fallback.tolist()  # the table moved the order
    assert len(_table_upto(sampler.curriculum, per_epoch)[0]) >= per_epoch - 8  # all but the crossing batch
    whole_run = Trainer(cfg, tmp_path / "w2").train()
    first = Trainer(cfg, tmp_path / "split").train(stop_after=per_epoch // 8 + 2)  # stopped inside epoch 2
    assert first.steps < 14
    resumed = Trainer(cfg, tmp_path / "split", resume=True).train()
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "w2" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows] == [(r["step"], r["loss"], r["grad_norm"])
                                                                      for r in ref]
    assert resumed.tokens == whole_run.tokens


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="needs an MoE model with moe.top_k >= 2 and moe.adaptive_threshold"):
        tiny("data.order=complexity")
    assert with_overrides(tiny(*CUR), ["parallel.pp=2", "parallel.nproc=2"]).pipelined  # a pipeline records too
    assert with_overrides(tiny(*CUR), ["parallel.pp=2", "parallel.nproc=2", "pipeline.microbatching=dynamic"])
    with pytest.raises(ConfigError, match="routes a subset of the tokens"):
        with_overrides(tiny(*CUR), ["dynamism.scheme=early_exit"])


def test_a_resume_under_another_lag_orders_the_rest_of_the_epoch_as_it_began():
    """A checkpoint mid-epoch resumed by a reader with another lag (planned micro-batching switched on or off, or
    another lookahead): the restored epoch keeps the order it began with, so every sample comes once in it; the
    new lag orders the next epoch."""
    from moebal.data import build_data

    cfg = with_overrides(tiny(*CUR), ["data.batch_size=4"])

    def sampler(lag: int):
        s = build_data(cfg).train
        s.set_curriculum_lag(lag)
        return s

    whole = sampler(8)
    N = whole.state_dict()["samples"]
    for i in range(N):  # one entry per sample, the last 8 within the lag
        whole.curriculum.record([i], np.array([[float((7 * i) % N)]]), [8], at=i + 1)
    while whole.epoch == 0:
        whole.next_sample()
    first = [whole.next_sample() for _ in range(3)]
    state = whole.state_dict()
    assert state["curriculum_lag"] == 8
    rest = [tuple(whole.next_sample()) for _ in range(N - 3)]
    resumed = sampler(0)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [tuple(resumed.next_sample()) for _ in range(N - 3)] == rest  # as it began, not re-ordered with lag 0
    assert len(first) == 3 and resumed.epoch == 2
    assert resumed.state_dict()["curriculum_lag"] == 0  # the next epoch under the new lag


def test_a_resume_inside_the_third_epoch_reads_the_uninterrupted_batches(tmp_path):
    """A sample of the batch that crosses into epoch 2, drawn again in epoch 2 before the checkpoint, has two
    entries newer than the one epoch 2's order used: with only two kept, the resume ordered epoch 2 without it
    (the sample counted as unseen) and every later batch of the epoch differed."""
    cfg = tiny(*CUR, "train.steps=30")
    whole = Trainer(cfg, tmp_path / "whole")
    assert whole.data.train._num_samples() == 77  # epoch 2 starts in step 20's batch (positions 152-159)
    whole.train()
    Trainer(cfg, tmp_path / "split").train(stop_after=26)
    Trainer(cfg, tmp_path / "split", resume=True).train()
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows] == [(r["step"], r["loss"], r["grad_norm"])
                                                                      for r in ref]
