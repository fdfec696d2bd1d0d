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

Storage: a path table keeps each path's counts sparse (CSR: only the non-zero (path, expert) counts), since at real
sizes a path reaches few experts: 256 experts, top-8, paths of 3 layers, 524,288 Zipf-skewed tokens (236,923 full
paths): layer 3's tables hold 56.5 MiB, against 0.54 GiB of dense int64 [P, E] counts (formats 1 and 2) and 1.06 GiB
more of float64 [P, E] distributions the dense code cached for its estimates (docs/expert-parallel.md, "Lina's
sample paths"). An estimate reads only the non-zeros of the paths its batch hits.

Shape legend: L MoE layers, T tokens, K = top_k, E experts, P profiled paths, m path length, N non-zero (path,
expert) counts, U distinct paths of a batch, V their non-zeros.
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["PathProfile", "PathTable", "build_profile", "estimate_accuracy", "previous_estimate", "top_set"]

_UNREADABLE = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)
"""What reading a truncated, empty or foreign .npz raises (numpy opens members lazily)."""
# 3: the counts sparse (per path its non-zero experts and counts); 2: dense [P, E] counts, layer 0's marginal stored;
# 1: dense, no table for layer 0. Formats 1 and 2 are still read (converted to the sparse layout).
FORMAT = 3
# E^m at most this: a path table keeps a code -> row array for its lookups (int32, 1 MB at most per table: 64
# experts with paths of 3 layers fit; a larger space uses the sorted codes)
_DENSE_CODES = 1 << 18


@dataclass(frozen=True)
class PathTable:
    """Observed paths of one length m before one layer: keys [P, m] (expert ids, oldest layer first), tokens per path
    [P] and the next layer's assignment counts per path, sparse (CSR): path p's non-zero counts are
    counts_N[start_P1[p]:start_P1[p + 1]], of the experts experts_N[...] in ascending order (of E experts)."""

    keys_Pm: np.ndarray
    start_P1: np.ndarray
    experts_N: np.ndarray
    counts_N: np.ndarray
    tokens_P: np.ndarray
    num_experts: int
    cache: dict[object, Any] = field(default_factory=dict, compare=False, repr=False)  # see index, _nonzeros, rows

    @property
    def index(self) -> dict[tuple[int, ...], int]:
        """path -> row, built on first use: only paths too long for int64 codes look rows up in it (a dictionary
        of 402,434 paths of 3 layers holds 55 MiB, about what their sparse counts do)."""
        if "index" not in self.cache:
            self.cache["index"] = {tuple(int(v) for v in k): i for i, k in enumerate(self.keys_Pm)}
        out: dict[tuple[int, ...], int] = self.cache["index"]
        return out

    def psi(self, rows_U: np.ndarray, truncate: int | None = None) -> np.ndarray:
        """psi_UE: the distribution of the next layer's assignments (sums to k; `truncate`: its k largest entries)
        of each path in `rows_U`, dense: the counts divided by the path's tokens, as a dense [P, E] table would."""
        row_V, experts_V, psi_V = self.psi_nonzeros(rows_U, truncate)
        psi_UE = np.zeros((len(rows_U), self.num_experts))
        psi_UE[row_V, experts_V] = psi_V
        return psi_UE

    def psi_nonzeros(self, rows_U: np.ndarray, truncate: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The non-zero entries of `psi(rows_U, truncate)`, V of them, by path then expert: (their position in
        rows_U, their expert, their value)."""
        row_V, experts_V, counts_V = self._gather(rows_U, truncate)
        return row_V, experts_V, counts_V / np.maximum(self.tokens_P[rows_U], 1)[row_V]

    def counts(self, rows_U: np.ndarray) -> np.ndarray:
        """counts_UE: the assignment counts of each path in `rows_U`, dense (int64)."""
        row_V, experts_V, counts_V = self._gather(rows_U, None)
        counts_UE = np.zeros((len(rows_U), self.num_experts), dtype=np.int64)
        counts_UE[row_V, experts_V] = counts_V
        return counts_UE

    def _gather(self, rows_U: np.ndarray, truncate: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The non-zeros of the paths `rows_U` (V of them): (their position in rows_U, expert, count)."""
        start_P1, experts_N, counts_N = self._nonzeros(truncate)
        rows_U = np.asarray(rows_U, dtype=np.int64)
        lo_U = start_P1[rows_U]
        len_U = start_P1[rows_U + 1] - lo_U
        row_V = np.repeat(np.arange(len(rows_U)), len_U)
        # the V-th non-zero lies at its path's start plus its place among the path's non-zeros
        at_V = np.arange(len(row_V)) + np.repeat(lo_U - (np.cumsum(len_U) - len_U), len_U)
        return row_V, experts_N[at_V], counts_N[at_V]

    def _nonzeros(self, truncate: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start_P1, experts_N, counts_N) of the whole table, or of each path's `truncate` largest counts (ties:
        lower expert id, as `_keep_top` on the distribution: a path's entries share its token count), computed
        once per table and truncation."""
        if truncate is None:
            return self.start_P1, self.experts_N, self.counts_N
        key = ("top", truncate)
        if key not in self.cache:
            P = len(self.tokens_P)
            row_N = np.repeat(np.arange(P), np.diff(self.start_P1))
            order = np.lexsort((self.experts_N, -self.counts_N, row_N))  # path first: each path's order in place
            keep = np.sort(order[np.arange(len(order)) - self.start_P1[row_N] < truncate])
            self.cache[key] = (_starts(np.bincount(row_N[keep], minlength=P)), self.experts_N[keep],
                               self.counts_N[keep])
        out: tuple[np.ndarray, np.ndarray, np.ndarray] = self.cache[key]
        return out

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
            psi_TE[hit] = tab.psi(rows)
        return psi_TE

    def estimate(self, paths_TL: np.ndarray, layer: int, truncate: int | None = None,
                 min_tokens: int = 1) -> np.ndarray:
        """est_E: the batch's expected assignments to each expert of `layer` (Lina's sum over tokens of
        P_{j(t)}(e)); `truncate=k` keeps only each token's k most likely experts (the thesis's top-k of Psi).

        Tokens of one path share its distribution, so the sum over tokens is a sum over the paths seen, each
        weighted by its tokens: per path length, one bincount of the tokens per path and one weighted bincount over
        the non-zeros of the paths hit, not a [T, E] gather (the estimate runs between the gate and the all-to-all of
        every scheduled layer). Per expert the products tokens x psi are added in path order, one at a time: the
        bits a dense `(tokens_P[:, None] * psi_PE).sum(axis=0)` gives (the paths the batch misses add exact zeros),
        whatever the BLAS (a `tokens_P @ psi_PE` product's rounding depends on its kernel's blocking)."""
        est_E = np.zeros(self.num_experts)
        for tab, _, rows in self._backed_off(paths_TL, layer, min_tokens):
            hits_P = np.bincount(rows, minlength=len(tab.tokens_P))  # the batch's tokens per path
            rows_U = np.flatnonzero(hits_P)
            row_V, experts_V, psi_V = tab.psi_nonzeros(rows_U, truncate)
            est_E += np.bincount(experts_V, weights=hits_P[rows_U][row_V] * psi_V, minlength=self.num_experts)
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

    # ---- storage: one .npz, only observed paths and their non-zero counts ----
    def save(self, path: str | Path) -> None:
        arrays: dict[str, np.ndarray] = {"meta": np.array([FORMAT, self.num_experts, self.top_k, self.path_len,
                                                           self.num_layers], dtype=np.int64)}
        for j, tabs in enumerate(self.tables):
            for m, t in enumerate(tabs):
                arrays[f"L{j}_m{m}_keys"] = t.keys_Pm.astype(np.int16)
                arrays[f"L{j}_m{m}_nonzeros"] = np.diff(t.start_P1).astype(np.int32)
                arrays[f"L{j}_m{m}_experts"] = t.experts_N.astype(np.int16)
                arrays[f"L{j}_m{m}_counts"] = t.counts_N.astype(np.int32)
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
        if fmt not in (1, 2, FORMAT):
            raise ValueError(f"{path}: path profile format {fmt}, this moebal reads 1 to {FORMAT}: rebuild it with "
                             f"`moebal paths RUN_DIR -o FILE`")
        if not (E >= 1 and 1 <= K <= E and l_ >= 1 and L >= 0):
            raise ValueError(f"{path}: path profile damaged: {E} experts, top-k {K}, path length {l_}, {L} layers "
                             f"(needs at least 1 expert, 1 <= top-k <= experts, a path length >= 1); rebuild it with "
                             f"`moebal paths RUN_DIR -o FILE`")
        lengths = [min(l_, j) + 1 if j or fmt >= 2 else 0 for j in range(L)]  # format 1: no table for layer 0
        try:
            tables = tuple(tuple(_read_table(z, f"L{j}_m{m}_", m, E, dense=fmt < 3) for m in range(lengths[j]))
                           for j in range(L))
        except (*_UNREADABLE, KeyError) as e:
            raise ValueError(f"{path}: path profile incomplete or damaged ({e}); rebuild it with `moebal paths "
                             f"RUN_DIR -o FILE`") from e
        return cls(num_experts=E, top_k=K, path_len=l_, tables=tables)


def _read_table(z: Any, name: str, m: int, E: int, dense: bool) -> PathTable:
    """One table of an .npz: sparse (format 3) or dense [P, E] counts (formats 1 and 2), checked (ValueError:
    what does not fit)."""
    keys_Pm = z[name + "keys"].astype(np.int64)
    tokens_P = z[name + "tokens"].astype(np.int64)
    P = len(keys_Pm)
    if keys_Pm.ndim != 2 or keys_Pm.shape[1] != m or tokens_P.shape != (P,):
        raise ValueError(f"{name}keys {keys_Pm.shape} and {name}tokens {tokens_P.shape}: not [P, {m}] and [P]")
    if dense:
        counts_PE = z[name + "counts"]
        if counts_PE.shape != (P, E):
            raise ValueError(f"{name}counts {counts_PE.shape}: not [P, E] = {(P, E)}")
        rows_N, experts_N = np.nonzero(counts_PE)  # row-major: by path, then expert (the CSR order)
        start_P1, counts_N = _starts(np.bincount(rows_N, minlength=P)), counts_PE[rows_N, experts_N]
    else:
        nonzeros_P, experts_N, counts_N = (z[name + k] for k in ("nonzeros", "experts", "counts"))
        if nonzeros_P.shape != (P,) or nonzeros_P.min(initial=0) < 0 or experts_N.ndim != 1 \
                or experts_N.shape != counts_N.shape or len(experts_N) != nonzeros_P.sum():
            raise ValueError(f"{name}nonzeros {nonzeros_P.shape}, experts {experts_N.shape}, counts "
                             f"{counts_N.shape}: not [P] non-zeros per path and their [N] experts and counts")
        start_P1 = _starts(nonzeros_P)
        up_N1 = np.diff(experts_N.astype(np.int64)) > 0
        up_N1[start_P1[(start_P1 > 0) & (start_P1 < len(experts_N))] - 1] = True  # a path's first: any expert
        if not up_N1.all():
            raise ValueError(f"{name}experts: not ascending within each path")
    if len(experts_N) and (experts_N.min() < 0 or experts_N.max() >= E):
        raise ValueError(f"{name}experts: ids outside 0..{E - 1}")
    if keys_Pm.size and (keys_Pm.min() < 0 or keys_Pm.max() >= E):
        raise ValueError(f"{name}keys: expert ids outside 0..{E - 1}")
    if P > 1:  # the lookups (`PathTable.rows`) need unique keys in ascending order (np.unique's)
        step_Pm = np.diff(keys_Pm, axis=0)
        first_P = np.argmax(step_Pm != 0, axis=1) if m else np.zeros(P - 1, dtype=np.int64)
        if m == 0 or not (step_Pm[np.arange(P - 1), first_P] > 0).all():
            raise ValueError(f"{name}keys: not unique paths in ascending order")
    if (counts_N < 0).any() or (tokens_P < 0).any():
        raise ValueError(f"{name}counts or tokens: negative")
    return PathTable(keys_Pm=keys_Pm, start_P1=start_P1, experts_N=experts_N.astype(np.int32),
                     counts_N=counts_N.astype(np.int64), tokens_P=tokens_P, num_experts=E)


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
    # one code per assignment, path * E + expert: sorted and counted, the codes are the table's CSR order
    codes_N, counts_N = np.unique(np.repeat(inv, K) * E + ids_TK.reshape(-1), return_counts=True)
    tokens_P = np.bincount(inv, minlength=P).astype(np.int64)
    return PathTable(keys_Pm=keys_Pm, start_P1=_starts(np.bincount(codes_N // E, minlength=P)),
                     experts_N=(codes_N % E).astype(np.int32), counts_N=counts_N.astype(np.int64), tokens_P=tokens_P,
                     num_experts=E)


def _starts(nonzeros_P: np.ndarray) -> np.ndarray:
    """start_P1: where each path's non-zeros begin (and the last ends), from their numbers."""
    start_P1 = np.zeros(len(nonzeros_P) + 1, dtype=np.int64)
    np.cumsum(nonzeros_P, out=start_P1[1:])
    return start_P1


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
