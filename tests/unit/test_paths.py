"""Lina's sample-path profile and estimate (moebal/planner/paths.py) on hand-made routing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moebal.planner.paths import PathProfile, build_profile, estimate_accuracy, previous_estimate, top_set


def _sample() -> np.ndarray:
    """[L=3, T=6, K=1]: tokens 0-2 take expert 0 then 1 then {2, 2, 3}; tokens 3-5 take 1, 1, then {0, 0, 0}."""
    top1 = np.array([[0, 0, 0, 1, 1, 1],
                     [1, 1, 1, 1, 1, 1],
                     [2, 2, 3, 0, 0, 0]])
    return top1[:, :, None]


def test_exact_distributions_per_path_and_back_off() -> None:
    prof = build_profile([_sample()], num_experts=4, path_len=2)
    # layer 2 given path (layer 0, layer 1) = (0, 1): 2/3 expert 2, 1/3 expert 3; (1, 1): all expert 0
    paths = np.array([[0, 1], [1, 1]])
    psi = prof.distributions(paths, layer=2)
    np.testing.assert_allclose(psi, [[0, 0, 2 / 3, 1 / 3], [1, 0, 0, 0]])
    # unseen full path (2, 1) backs off to the path (1,) of length 1: every token of layer 1 took expert 1
    psi = prof.distributions(np.array([[2, 1]]), layer=2)
    np.testing.assert_allclose(psi, [[3 / 6, 0, 2 / 6, 1 / 6]])
    # unseen at every length: the layer's marginal (same here, since every path's suffix (1,) was seen)
    psi = prof.distributions(np.array([[3, 3]]), layer=2)
    np.testing.assert_allclose(psi, [[3 / 6, 0, 2 / 6, 1 / 6]])
    # layer 1 from layer 0 alone: paths (0,) and (1,) both go to expert 1
    np.testing.assert_allclose(prof.distributions(np.array([[0], [1]]), layer=1), [[0, 1, 0, 0]] * 2)


def test_min_tokens_backs_off_from_rare_paths() -> None:
    prof = build_profile([_sample()], num_experts=4, path_len=2)
    psi = prof.distributions(np.array([[0, 1]]), layer=2, min_tokens=4)  # (0, 1) seen 3 times: too rare
    np.testing.assert_allclose(psi, [[3 / 6, 0, 2 / 6, 1 / 6]])


def test_top_k_routing_counts_every_choice() -> None:
    ids = np.array([[[0, 1], [0, 2]], [[2, 3], [3, 0]]])  # [L=2, T=2, K=2]
    prof = build_profile([ids], num_experts=4, path_len=3)
    psi = prof.distributions(np.array([[0], [0]]), layer=1)  # both tokens' first choice in layer 0 was 0
    np.testing.assert_allclose(psi[0], [0.5, 0, 0.5, 1.0])  # sums to k = 2
    assert prof.tables[1][1].keys_Pm.tolist() == [[0]]


def test_estimate_sums_and_truncation() -> None:
    prof = build_profile([_sample()], num_experts=4, path_len=2)
    paths = np.array([[0, 1], [0, 1], [1, 1]])
    np.testing.assert_allclose(prof.estimate(paths, 2), [1, 0, 4 / 3, 2 / 3])
    np.testing.assert_allclose(prof.estimate(paths, 2, truncate=1), [1, 0, 4 / 3, 0])  # Lina's top-1 of Psi


def test_save_load_round_trip(tmp_path: Path) -> None:
    prof = build_profile([_sample(), _sample()], num_experts=4, path_len=3)
    prof.save(tmp_path / "p.npz")
    back = PathProfile.load(tmp_path / "p.npz")
    assert (back.num_experts, back.top_k, back.path_len, back.num_layers) == (4, 1, 3, 3)
    paths = np.array([[0, 1], [1, 1], [3, 1]])
    np.testing.assert_allclose(back.estimate(paths, 2), prof.estimate(paths, 2))
    np.testing.assert_allclose(back.estimate(paths[:, :0], 0), prof.estimate(paths[:, :0], 0))  # layer 0 too
    with pytest.raises(ValueError, match="not a path profile"):
        PathProfile.load(tmp_path / "missing.npz")
    prof.save(tmp_path / "profile")  # a name without .npz is kept as given
    assert sorted(f.name for f in tmp_path.iterdir()) == ["p.npz", "profile"]
    assert PathProfile.load(tmp_path / "profile").num_layers == 3


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="expert ids outside"):
        build_profile([_sample()], num_experts=2)
    with pytest.raises(ValueError, match="path_len"):
        build_profile([_sample()], num_experts=4, path_len=0)
    with pytest.raises(ValueError, match="layers 0..2"):
        build_profile([_sample()], num_experts=4).distributions(np.zeros((1, 3), dtype=np.int64), layer=3)


def test_layer_0_is_estimated_from_its_marginal() -> None:
    """Layer 0 has no path before it: every token gets the layer's profiled popularity (here 3 of 6 tokens took
    expert 0 and 3 expert 1)."""
    prof = build_profile([_sample()], num_experts=4, path_len=2)
    assert prof.estimates(0) and len(prof.tables[0]) == 1
    no_path = np.zeros((5, 0), dtype=np.int64)
    np.testing.assert_allclose(prof.distributions(no_path, layer=0), [[0.5, 0.5, 0, 0]] * 5)
    np.testing.assert_allclose(prof.estimate(no_path, 0), [2.5, 2.5, 0, 0])
    np.testing.assert_allclose(prof.estimate(no_path, 0, truncate=1), [2.5, 0, 0, 0])  # ties: lower expert id
    # a stage's profile: its first layer keeps its marginal alone
    part = prof.layers(1, 3)
    assert [len(t) for t in part.tables] == [1, 2]
    np.testing.assert_allclose(part.estimate(np.zeros((2, 0), dtype=np.int64), 0), [0, 2, 0, 0])


def test_format_1_files_load_without_layer_0(tmp_path: Path) -> None:
    """A profile written before layer 0's marginal was stored (format 1) still loads; it estimates layers 1 on,
    and asking it for layer 0 names the fix."""
    prof = build_profile([_sample()], num_experts=4, path_len=2)
    prof.save(tmp_path / "p2.npz")
    with np.load(tmp_path / "p2.npz") as z:
        arrays = {k: z[k] for k in z.files if not k.startswith("L0_")}
    arrays["meta"] = arrays["meta"].copy()
    arrays["meta"][0] = 1
    np.savez_compressed(tmp_path / "p1.npz", **arrays)
    old = PathProfile.load(tmp_path / "p1.npz")
    assert not old.estimates(0) and old.estimates(1)
    paths = np.array([[0, 1], [1, 1]])
    np.testing.assert_allclose(old.estimate(paths, 2), prof.estimate(paths, 2))
    with pytest.raises(ValueError, match="rebuild it with `moebal paths"):
        old.estimate(np.zeros((1, 0), dtype=np.int64), 0)
    arrays["meta"][0] = 9
    np.savez_compressed(tmp_path / "p9.npz", **arrays)
    with pytest.raises(ValueError, match="format 9"):
        PathProfile.load(tmp_path / "p9.npz")


def test_accuracy_metrics() -> None:
    acc = estimate_accuracy(np.array([4.0, 3, 2, 1]), np.array([3.0, 4, 1, 2]), top_n=2)
    assert acc["overlap"] == 1.0 and acc["equal"] == 1.0 and acc["mae"] == 1.0 and acc["rel_mae"] == 0.4
    acc = estimate_accuracy(np.array([1.0, 1, 0, 0]), np.array([0.0, 1, 1, 0]), top_n=2)
    assert acc["overlap"] == 0.5 and acc["equal"] == 0.0
    assert top_set(np.array([1.0, 2, 2, 0]), 2) == {1, 2}
    np.testing.assert_allclose(previous_estimate(np.array([2, 4]), 6, 12), [4, 8])


def test_row_lookup_by_codes_and_by_dictionary_agree() -> None:
    tab = build_profile([_sample()], num_experts=4, path_len=2).tables[2][2]
    keys = np.array([[0, 1], [1, 1], [2, 1], [1, 0]])
    assert tab.rows(keys, 4).tolist() == [0, 1, -1, -1]
    assert tab.rows(keys, 2 ** 40).tolist() == [0, 1, -1, -1]  # codes would overflow: dictionary lookup


def test_estimate_is_the_sum_of_the_tokens_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate sums per path (tokens x the path's distribution); it must equal the per-token sum, with
    back-off, min_tokens and truncation, whichever lookup the tables use (dense code array or sorted codes)."""
    import moebal.planner.paths as paths_mod

    rng = np.random.default_rng(3)
    E, L, K = 6, 5, 2
    samples = [np.argsort(rng.random((L, 40, E)), axis=2)[:, :, :K] for _ in range(3)]  # [L, T, K], distinct
    paths_TL = rng.integers(0, E, size=(200, L))  # many paths unseen: every back-off length is used
    reference = build_profile(samples, E, path_len=3)

    def per_token(paths: np.ndarray, layer: int, min_tokens: int) -> np.ndarray:
        """Each token's distribution by dictionary lookup, one token at a time (the definition)."""
        out = np.zeros((len(paths), E))
        for t, path in enumerate(paths):
            for m in range(len(reference.tables[layer]) - 1, -1, -1):
                tab = reference.tables[layer][m]
                row = tab.index.get(tuple(int(v) for v in path[layer - m:layer]), -1)
                if row >= 0 and tab.tokens_P[row] >= (min_tokens if m else 1):
                    out[t] = tab.counts_PE[row] / tab.tokens_P[row]
                    break
        return out
    for dense_codes in (1 << 18, 0):  # the code -> row array, then sorted codes and searchsorted
        monkeypatch.setattr(paths_mod, "_DENSE_CODES", dense_codes)
        prof = build_profile(samples, E, path_len=3)  # nothing cached from the other lookup
        for layer in range(1, L):
            for min_tokens in (1, 3):
                psi_TE = per_token(paths_TL[:, :layer], layer, min_tokens)
                np.testing.assert_array_equal(prof.distributions(paths_TL[:, :layer], layer, min_tokens), psi_TE)
                np.testing.assert_allclose(prof.estimate(paths_TL[:, :layer], layer, min_tokens=min_tokens),
                                           psi_TE.sum(axis=0), rtol=1e-12)
                np.testing.assert_allclose(prof.estimate(paths_TL[:, :layer], layer, 1, min_tokens),
                                           paths_mod._keep_top(psi_TE, 1).sum(axis=0), rtol=1e-12)
        assert any(("lut", E) in t.cache for t in prof.tables[3]) == bool(dense_codes)
