"""Lina's expert popularity by sample path (thesis section 4.5, "Estimating expert popularity"): pure, numpy only.

Profile (offline): every token's expert choices in every MoE layer are recorded; for MoE layer j the tokens are
grouped by their *sample path* (their experts in the l layers before j) and each group's distribution of layer j's
experts is counted. Estimate (online, before layer j's gate): a batch's expected load of each expert of layer j is
the sum over its tokens of their paths' distributions.

How moebal settles the thesis's gaps (docs/expert-parallel.md, "Lina's sample paths"):
- **Which expert defines a path** (gap B1): each token's *first choice* (top-1, column 0 of the gate's top-k) per
  layer, under top-1 and top-k routing alike; the distribution of layer j counts *every* assignment (all k
  choices), so Psi_path(e) is the expected number of a path's tokens' assignments to e per token (sums to k).
- **Path window** (gap B3): the l layers before j (j-l .. j-1), so with l = 3 the first layer with a full path is
  the 4th (index 3), as the thesis's "scheduling starts at the 4th layer" says. Layer 0 has no path before it:
  the profile keeps its marginal alone (the empty path), so its estimate is the profiled popularity of layer 0,
  the same distribution for every token of every batch.
- **Unseen paths** (gap B2): back off to the longest suffix of the path (the most recent layers) seen at least
  `min_tokens` times in the profile, down to the layer's marginal distribution (the empty path), which exists
  for every profiled layer. Layers 1 .. l-1 therefore get estimates from shorter paths.
- **Top-k of Psi** (gap B4): `truncate=k` keeps each path's k most likely experts (the thesis's rule; the estimate
  then sums to less than the batch's assignments); `truncate=None` keeps the whole distribution (the expectation).

Shape legend: L MoE layers, T tokens, K = top_k, E experts, P profiled paths, m path length.
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["PathProfile", "PathTable", "build_profile", "estimate_accuracy", "previous_estimate", "top_set"]

_UNREADABLE = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)
"""What reading a truncated, empty or foreign .npz raises (numpy opens members lazily)."""
FORMAT = 2  # 2: layer 0's marginal is stored (format 1 had no table for layer 0; still read, without it)
# E^m at most this: a path table keeps a code -> row array for its lookups (int32, 1 MB at most per table: 64
# experts with paths of 3 layers fit; a larger space uses the sorted codes)
_DENSE_CODES = 1 << 18


@dataclass(frozen=True)
class PathTable:
    """Observed paths of one length m before one layer: keys [P, m] (expert ids, oldest layer first) and the
    next layer's assignment counts per path [P, E] and tokens per path [P]."""

    keys_Pm: np.ndarray
    counts_PE: np.ndarray
    tokens_P: np.ndarray
    index: dict[tuple[int, ...], int] = field(default_factory=dict, compare=False, repr=False)
    cache: dict[object, np.ndarray] = field(default_factory=dict, compare=False, repr=False)  # see psi, rows

    def __post_init__(self) -> None:
        if not self.index:
            self.index.update({tuple(int(v) for v in k): i for i, k in enumerate(self.keys_Pm)})

    def psi(self, truncate: int | None = None) -> np.ndarray:
        """psi_PE: each path's distribution of the next layer's assignments (sums to k; `truncate`: its k largest
        entries), computed once per table and truncation."""
        key = ("psi", truncate)
        if key not in self.cache:
            psi_PE = self.counts_PE / np.maximum(self.tokens_P, 1)[:, None]
            self.cache[key] = psi_PE if truncate is None else _keep_top(psi_PE, truncate)
        return self.cache[key]

    def rows(self, keys_Tm: np.ndarray, num_experts: int) -> np.ndarray:
        """The row of each key (-1: not observed). Keys are coded as base-E numbers, oldest layer most
        significant: up to _DENSE_CODES codes one array maps every code to its row, else the table's sorted keys
        (np.unique's order) are sorted codes and one searchsorted finds them all; paths too long for int64 codes
        fall back to a dictionary lookup per distinct key."""
        m = keys_Tm.shape[1]
        if num_experts ** max(m, 1) >= 2 ** 62:
            uniq, inv = np.unique(keys_Tm, axis=0, return_inverse=True)
            rows = np.array([self.index.get(tuple(int(v) for v in k), -1) for k in uniq], dtype=np.int64)
            out: np.ndarray = rows[inv.reshape(-1)]
            return out
        weights = num_experts ** np.arange(m - 1, -1, -1, dtype=np.int64)
        codes_T = keys_Tm.astype(np.int64) @ weights
        if num_experts ** m <= _DENSE_CODES:  # one lookup per token in a table of every code
            if ("lut", num_experts) not in self.cache:
                lut = np.full(num_experts ** m, -1, dtype=np.int32)
                lut[self.keys_Pm.astype(np.int64) @ weights] = np.arange(len(self.keys_Pm), dtype=np.int32)
                self.cache[("lut", num_experts)] = lut
            found: np.ndarray = self.cache[("lut", num_experts)][codes_T]
            return found
        if ("codes", num_experts) not in self.cache:
            self.cache[("codes", num_experts)] = self.keys_Pm.astype(np.int64) @ weights
        codes_P = self.cache[("codes", num_experts)]
        pos = np.minimum(np.searchsorted(codes_P, codes_T), max(len(codes_P) - 1, 0))
        hit = (codes_P[pos] == codes_T) if len(codes_P) else np.zeros(len(codes_T), dtype=bool)
        return np.where(hit, pos, -1)


@dataclass(frozen=True)
class PathProfile:
    """Per MoE layer j and path length m = 0 .. min(l, j): the observed paths and their next-expert counts.

    tables[j][m] describes layer j given the top-1 experts of layers j-m .. j-1 (m = 0: the layer's marginal);
    tables[0] holds layer 0's marginal alone (empty in a profile read from a format-1 file)."""

    num_experts: int
    top_k: int
    path_len: int
    tables: tuple[tuple[PathTable, ...], ...]

    @property
    def num_layers(self) -> int:
        return len(self.tables)

    def estimates(self, layer: int) -> bool:
        """Whether the profile can estimate `layer` (every profiled layer can, but layer 0 of a format-1 file)."""
        return 0 <= layer < self.num_layers and bool(self.tables[layer])

    def distributions(self, paths_TL: np.ndarray, layer: int, min_tokens: int = 1) -> np.ndarray:
        """psi_TE: each token's distribution of `layer`'s assignments (expected assignments per token, sums to
        k), from its path (top-1 experts of every layer before `layer`, [T, >= layer]) with back-off."""
        psi_TE = np.zeros((paths_TL.shape[0], self.num_experts))
        for tab, hit, rows in self._backed_off(paths_TL, layer, min_tokens):
            psi_TE[hit] = tab.psi()[rows]
        return psi_TE

    def estimate(self, paths_TL: np.ndarray, layer: int, truncate: int | None = None,
                 min_tokens: int = 1) -> np.ndarray:
        """est_E: the batch's expected assignments to each expert of `layer` (Lina's sum over tokens of
        P_{j(t)}(e)); `truncate=k` keeps only each token's k most likely experts (the thesis's top-k of Psi).

        Tokens of one path share its distribution, so the sum over tokens is a sum over the paths seen, each
        weighted by its tokens: one bincount per path length and a [P] x [P, E] product, not a [T, E] gather
        (the estimate runs between the gate and the all-to-all of every scheduled layer)."""
        est_E = np.zeros(self.num_experts)
        for tab, _, rows in self._backed_off(paths_TL, layer, min_tokens):
            psi_PE = tab.psi(truncate)
            est_E += np.bincount(rows, minlength=psi_PE.shape[0]).astype(np.float64) @ psi_PE
        return est_E

    def _backed_off(self, paths_TL: np.ndarray, layer: int, min_tokens: int
                    ) -> list[tuple[PathTable, np.ndarray, np.ndarray]]:
        """Per path length, longest first: (table, the tokens it answers, their rows in it). A token goes to
        the longest suffix of its path seen at least `min_tokens` times (the marginal, m = 0: at least once)."""
        E = self.num_experts
        if not self.estimates(layer):
            first = 0 if self.estimates(0) else 1
            raise ValueError(f"layer {layer}: the profile estimates layers {first}..{self.num_layers - 1}"
                             + ("" if first == 0 else " (a format-1 file has no layer 0: rebuild it with "
                                                      "`moebal paths RUN_DIR -o FILE` to estimate layer 0)"))
        tables = self.tables[layer]
        todo = np.ones(paths_TL.shape[0], dtype=bool)
        out: list[tuple[PathTable, np.ndarray, np.ndarray]] = []
        for m in range(len(tables) - 1, -1, -1):  # longest path first, then shorter suffixes
            if not todo.any():
                break
            tab = tables[m]
            idx = np.flatnonzero(todo)
            rows_T = tab.rows(paths_TL[idx, layer - m:layer], E)
            ok = rows_T >= 0
            ok[ok] = tab.tokens_P[rows_T[ok]] >= (min_tokens if m > 0 else 1)
            out.append((tab, idx[ok], rows_T[ok]))
            todo[idx[ok]] = False
        return out

    def layers(self, lo: int, hi: int) -> PathProfile:
        """The profile of MoE layers lo .. hi-1 alone (a pipeline stage's): layer lo becomes layer 0 (its marginal
        alone), and each layer keeps only the paths that lie inside the range (local layer k: lengths
        0 .. min(l, k)), so an estimate never needs a layer held elsewhere."""
        if not 0 <= lo <= hi <= self.num_layers:
            raise ValueError(f"layers {lo}..{hi - 1}: the profile describes MoE layers 0..{self.num_layers - 1}")
        tables = tuple(self.tables[lo + k][:min(self.path_len, k) + 1] for k in range(hi - lo))
        return PathProfile(num_experts=self.num_experts, top_k=self.top_k, path_len=self.path_len, tables=tables)

    # ---- storage: one .npz, only observed paths ----
    def save(self, path: str | Path) -> None:
        arrays: dict[str, np.ndarray] = {"meta": np.array([FORMAT, self.num_experts, self.top_k, self.path_len,
                                                           self.num_layers], dtype=np.int64)}
        for j, tabs in enumerate(self.tables):
            for m, t in enumerate(tabs):
                arrays[f"L{j}_m{m}_keys"] = t.keys_Pm.astype(np.int16)
                arrays[f"L{j}_m{m}_counts"] = t.counts_PE.astype(np.int32)
                arrays[f"L{j}_m{m}_tokens"] = t.tokens_P.astype(np.int32)
        # whole or not at all: a temporary file beside `path`, renamed over it; written through a handle, so numpy
        # does not append ".npz" to a name without it (the file is exactly `path`)
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)  # type: ignore[arg-type]  # numpy's stub wants a positional
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> PathProfile:
        try:
            z = np.load(Path(path))
            fmt, E, K, l_, L = (int(v) for v in z["meta"])
        except (*_UNREADABLE, KeyError) as e:
            raise ValueError(f"{path}: not a path profile ({e}); build one with `moebal paths RUN_DIR -o FILE`") \
                from e
        if fmt not in (1, FORMAT):
            raise ValueError(f"{path}: path profile format {fmt}, this moebal reads 1 and {FORMAT}: rebuild it with "
                             f"`moebal paths RUN_DIR -o FILE`")
        lengths = [min(l_, j) + 1 if j or fmt >= 2 else 0 for j in range(L)]  # format 1: no table for layer 0
        try:
            tables = tuple(tuple(PathTable(z[f"L{j}_m{m}_keys"].astype(np.int64),
                                           z[f"L{j}_m{m}_counts"].astype(np.int64),
                                           z[f"L{j}_m{m}_tokens"].astype(np.int64))
                                 for m in range(lengths[j]))
                           for j in range(L))
        except (*_UNREADABLE, KeyError) as e:
            raise ValueError(f"{path}: path profile incomplete or damaged ({e}); rebuild it with `moebal paths "
                             f"RUN_DIR -o FILE`") from e
        return cls(num_experts=E, top_k=K, path_len=l_, tables=tables)


def _keep_top(psi_TE: np.ndarray, k: int) -> np.ndarray:
    """Each row's k largest entries (ties: lower expert id), the rest zero."""
    order = np.argsort(-psi_TE, axis=1, kind="stable")[:, :k]
    out = np.zeros_like(psi_TE)
    np.put_along_axis(out, order, np.take_along_axis(psi_TE, order, axis=1), axis=1)
    return out


def build_profile(samples: Sequence[np.ndarray], num_experts: int, path_len: int = 3) -> PathProfile:
    """The profile of routing samples, each an int [L, T, K] array of top-k expert ids (column 0 the first
    choice); every sample must have the same L and K."""
    if path_len < 1:
        raise ValueError(f"path_len must be >= 1; got {path_len}")
    if not samples:
        raise ValueError("build_profile: no routing samples")
    L, _, K = samples[0].shape
    if any(s.ndim != 3 or s.shape[0] != L or s.shape[2] != K for s in samples):
        raise ValueError(f"build_profile: every sample must be [L={L}, T, K={K}]; got "
                         f"{[tuple(s.shape) for s in samples]}")
    ids_LTK = np.concatenate([np.asarray(s, dtype=np.int64) for s in samples], axis=1)
    if ids_LTK.min() < 0 or ids_LTK.max() >= num_experts:
        raise ValueError(f"build_profile: expert ids outside 0..{num_experts - 1}")
    top1_TL = ids_LTK[:, :, 0].T
    tables = [tuple(_table(top1_TL, ids_LTK[j], j, m, num_experts) for m in range(min(path_len, j) + 1))
              for j in range(L)]
    return PathProfile(num_experts=num_experts, top_k=K, path_len=path_len, tables=tuple(tables))


def _table(top1_TL: np.ndarray, ids_TK: np.ndarray, layer: int, m: int, E: int) -> PathTable:
    keys_Tm = top1_TL[:, layer - m:layer]
    keys_Pm, inv = np.unique(keys_Tm, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    P, K = keys_Pm.shape[0], ids_TK.shape[1]
    counts_PE = np.zeros((P, E), dtype=np.int64)
    np.add.at(counts_PE, (np.repeat(inv, K), ids_TK.reshape(-1)), 1)
    tokens_P = np.bincount(inv, minlength=P).astype(np.int64)
    return PathTable(keys_Pm=keys_Pm, counts_PE=counts_PE, tokens_P=tokens_P)


def previous_estimate(prev_counts_E: np.ndarray, prev_tokens: int, tokens: int) -> np.ndarray:
    """Pro-Prophet's forecast: the previous batch's counts of the layer, scaled to this batch's token count."""
    scale = tokens / prev_tokens if prev_tokens else 0.0
    out: np.ndarray = np.asarray(prev_counts_E, dtype=np.float64) * scale
    return out


def top_set(load_E: np.ndarray, n: int) -> frozenset[int]:
    """The n most loaded experts (ties: lower expert id first)."""
    order = np.argsort(-np.asarray(load_E, dtype=np.float64), kind="stable")
    return frozenset(int(e) for e in order[:n])


def estimate_accuracy(pred_E: np.ndarray, actual_E: np.ndarray, top_n: int) -> dict[str, float]:
    """How well a forecast of one layer's expert loads matches the real ones: the overlap of the top-n sets (a
    share), whether they are equal (Lina's "accurate"), and the mean absolute error of the counts after scaling
    the forecast to the real total (absolute, and as a share of the mean count)."""
    pred = np.asarray(pred_E, dtype=np.float64)
    act = np.asarray(actual_E, dtype=np.float64)
    total = pred.sum()
    pred = pred * (act.sum() / total) if total > 0 else pred
    a, b = top_set(pred, top_n), top_set(act, top_n)
    mae = float(np.abs(pred - act).mean())
    mean = float(act.mean())
    return {"overlap": len(a & b) / top_n, "equal": float(a == b), "mae": mae,
            "rel_mae": mae / mean if mean > 0 else 0.0}
