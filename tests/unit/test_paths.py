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


def _dense_arrays(prof: PathProfile, fmt: int) -> dict[str, np.ndarray]:
    """The arrays of a format-1 or format-2 file, as moebal wrote them before format 3: dense [P, E] counts (and in
    format 1 no table for layer 0)."""
    arrays = {"meta": np.array([fmt, prof.num_experts, prof.top_k, prof.path_len, prof.num_layers], dtype=np.int64)}
    for j, tabs in enumerate(prof.tables):
        for m, t in enumerate(tabs if j or fmt >= 2 else ()):
            arrays[f"L{j}_m{m}_keys"] = t.keys_Pm.astype(np.int16)
            arrays[f"L{j}_m{m}_counts"] = t.counts(np.arange(len(t.tokens_P))).astype(np.int32)
            arrays[f"L{j}_m{m}_tokens"] = t.tokens_P.astype(np.int32)
    return arrays


def test_format_1_files_load_without_layer_0(tmp_path: Path) -> None:
    """A profile written before layer 0's marginal was stored (format 1) still loads; it estimates layers 1 on,
    and asking it for layer 0 names the fix."""
    prof = build_profile([_sample()], num_experts=4, path_len=2)
    arrays = _dense_arrays(prof, fmt=1)
    np.savez_compressed(tmp_path / "p1.npz", **arrays)
    old = PathProfile.load(tmp_path / "p1.npz")
    assert not old.estimates(0) and old.estimates(1)
    paths = np.array([[0, 1], [1, 1]])
    np.testing.assert_array_equal(old.estimate(paths, 2), prof.estimate(paths, 2))
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
                    out[t] = tab.counts(np.array([row]))[0] / tab.tokens_P[row]
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


def _skewed_samples(rng: np.random.Generator, E: int, L: int, K: int, T: int) -> list[np.ndarray]:
    """[L, T, K] samples of distinct experts per token, Zipf-skewed (a few experts take most tokens)."""
    logits = np.log(1.0 / np.arange(1, E + 1))[rng.permutation(E)]
    return [np.argsort(-(logits + rng.gumbel(size=(L, T, E))), axis=2, kind="stable")[:, :, :K] for _ in range(2)]


def _dense_tables(samples: list[np.ndarray], E: int, path_len: int) -> list[list[tuple[dict, np.ndarray, np.ndarray]]]:
    """The dense profile, as moebal built it before the sparse layout: per layer and path length, the path ->
    row dictionary, counts [P, E] (np.add.at over every assignment) and tokens [P]."""
    ids_LTK = np.concatenate(samples, axis=1)
    top1_TL = ids_LTK[:, :, 0].T
    out = []
    for j in range(ids_LTK.shape[0]):
        layer = []
        for m in range(min(path_len, j) + 1):
            keys_Pm, inv = np.unique(top1_TL[:, j - m:j], axis=0, return_inverse=True)
            inv = inv.reshape(-1)
            counts_PE = np.zeros((len(keys_Pm), E), dtype=np.int64)
            np.add.at(counts_PE, (np.repeat(inv, ids_LTK.shape[2]), ids_LTK[j].reshape(-1)), 1)
            index = {tuple(int(v) for v in k): i for i, k in enumerate(keys_Pm)}
            layer.append((index, counts_PE, np.bincount(inv, minlength=len(keys_Pm))))
        out.append(layer)
    return out


def test_sparse_profile_equals_the_dense_one_bit_for_bit(tmp_path: Path) -> None:
    """The sparse tables hold the dense tables' counts, and every distribution and estimate (back-off, min_tokens,
    truncation with its ties) has the bits of the dense tables' sum over paths in path order: each token's path
    looked up in a dictionary, tokens x psi_PE summed over every path (the missed ones add zeros), longest path
    length first. A format-2 file of the same profile loads to the same bits."""
    import moebal.planner.paths as paths_mod

    rng = np.random.default_rng(11)
    E, L, K, l_ = 12, 5, 3, 3
    samples = _skewed_samples(rng, E, L, K, 300)
    dense = _dense_tables(samples, E, l_)
    prof = build_profile(samples, E, path_len=l_)
    for tabs, ref in zip(prof.tables, dense, strict=True):
        for tab, (_, counts_PE, tokens_P) in zip(tabs, ref, strict=True):
            np.testing.assert_array_equal(tab.counts(np.arange(len(tab.tokens_P))), counts_PE)
            np.testing.assert_array_equal(tab.tokens_P, tokens_P)
            assert len(tab.counts_N) == np.count_nonzero(counts_PE)  # only the non-zeros
    assert len(prof.tables[4][3].counts_N) < prof.tables[4][3].counts(np.arange(len(prof.tables[4][3].tokens_P))).size
    np.savez_compressed(tmp_path / "p2.npz", **_dense_arrays(prof, fmt=2))
    prof.save(tmp_path / "p3.npz")
    loaded = [PathProfile.load(tmp_path / "p2.npz"), PathProfile.load(tmp_path / "p3.npz")]
    paths_TL = np.concatenate([samples[0][:, :, 0].T[:150],  # seen paths, and unseen ones: every back-off
                               rng.integers(0, E, size=(150, L))])

    def reference(layer: int, truncate: int | None, min_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        psi_TE, est_E = np.zeros((len(paths_TL), E)), np.zeros(E)
        todo = np.ones(len(paths_TL), dtype=bool)
        for m in range(len(dense[layer]) - 1, -1, -1):
            index, counts_PE, tokens_P = dense[layer][m]
            psi_PE = counts_PE / np.maximum(tokens_P, 1)[:, None]
            tokens_used_P = np.zeros(len(tokens_P))
            for t in np.flatnonzero(todo):
                row = index.get(tuple(int(v) for v in paths_TL[t, layer - m:layer]), -1)
                if row >= 0 and tokens_P[row] >= (min_tokens if m else 1):
                    psi_TE[t], todo[t] = psi_PE[row], False
                    tokens_used_P[row] += 1
            kept_PE = psi_PE if truncate is None else paths_mod._keep_top(psi_PE, truncate)
            est_E += (tokens_used_P[:, None] * kept_PE).sum(axis=0)
        return psi_TE, est_E
    for layer in range(L):
        for min_tokens in (1, 4):
            for truncate in (None, 1, 2, E):
                psi_TE, est_E = reference(layer, truncate, min_tokens)
                for p in (prof, *loaded):
                    np.testing.assert_array_equal(p.distributions(paths_TL[:, :layer], layer, min_tokens), psi_TE)
                    np.testing.assert_array_equal(p.estimate(paths_TL[:, :layer], layer, truncate, min_tokens), est_E)


def test_damaged_sparse_files_are_named(tmp_path: Path) -> None:
    """A format-3 file whose sparse arrays do not fit together is refused with the table and what is wrong."""
    prof = build_profile([_sample()], num_experts=4, path_len=2)
    prof.save(tmp_path / "p.npz")
    with np.load(tmp_path / "p.npz") as z:
        good = {k: z[k] for k in z.files}
    assert good["meta"][0] == 3
    experts = good["L2_m2_experts"]
    assert experts.tolist() == [2, 3, 0]  # paths (0, 1): experts 2 and 3; (1, 1): expert 0
    for change, match in ((("L2_m2_experts", experts + 4), "ids outside 0..3"),
                          (("L2_m2_experts", experts[[1, 0, 2]]), "not ascending"),  # path (0, 1): experts 3, 2
                          (("L2_m2_nonzeros", good["L2_m2_nonzeros"] + 1), "non-zeros per path"),
                          (("L2_m2_counts", good["L2_m2_counts"][:-1]), "non-zeros per path"),
                          (("L2_m2_keys", good["L2_m2_keys"][:, :1]), "not \\[P, 2\\]"),
                          (("L2_m2_tokens", None), "incomplete or damaged"),
                          # accepted once, then an IndexError, a negative estimate or a division by zero later
                          (("L2_m2_keys", good["L2_m2_keys"] + 4), "keys: expert ids outside 0..3"),
                          (("L2_m2_keys", good["L2_m2_keys"][::-1]), "not unique paths in ascending order"),
                          (("L2_m2_counts", -good["L2_m2_counts"]), "negative"),
                          (("L2_m2_tokens", -good["L2_m2_tokens"]), "negative"),
                          (("meta", good["meta"] * np.array([1, 1, 0, 1, 1])), "top-k 0")):
        arrays = dict(good)
        if change[1] is None:
            del arrays[change[0]]
        else:
            arrays[change[0]] = change[1]
        np.savez_compressed(tmp_path / "bad.npz", **arrays)
        with pytest.raises(ValueError, match=match):
            PathProfile.load(tmp_path / "bad.npz")
