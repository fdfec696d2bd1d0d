"""Fit a hardware profile to micro-benchmark records (pure numpy; the measuring lives in `moebal calibrate`).

Records are plain dicts:
- gemm:       {"dtype", "m", "n", "k", "s"}              seconds of one (m x k) @ (k x n) product (any layout)
- memory:     {"op", "bytes", "s"}                         an elementwise kernel reading + writing `bytes`
- attention:  {"dtype", "batch", "heads", "seq", "head_dim", "s", "fwd_bwd_s"}   causal SDPA
- collective: {"kind", "world", "bytes", "s"}              gloo collective; bytes = payload per rank
- experts:    {"dtype", "dim", "ffn", "rows", "s"}         moebal's expert kernel forward + backward, rows per expert
- optimizer:  {"params", "s"}                               one AdamW step
- overhead:   {"ops", "s"}                                  a chain of `ops` tiny autograd ops, forward + backward

Every fit minimises relative error (the records span orders of magnitude) and reports its residuals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from moebal.errors import ConfigError
from moebal.planner.hardware import CollectiveSpec, GemmSpec, HardwareProfile, LinkSpec

__all__ = ["collective_terms", "fit_gemm", "fit_collectives", "fit_profile"]

HALF_DIMS = (0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
CACHE_BYTES = (0.0, 2.5e5, 5e5, 1e6, 2e6, 4e6, 8e6, 16e6, 32e6)
OUT_OF_CACHE = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _rel_lstsq(A: np.ndarray, t: np.ndarray, nonneg: bool = True) -> tuple[np.ndarray, float]:
    """x minimising sum ((A x - t) / t)^2 (with x >= 0 via clipping and a refit); returns (x, median |rel err|)."""
    W = A / t[:, None]
    x, *_ = np.linalg.lstsq(W, np.ones_like(t), rcond=None)
    if nonneg and (x < 0).any():
        keep = x >= 0
        x = np.zeros_like(x)
        if keep.any():
            x[keep], *_ = np.linalg.lstsq(W[:, keep], np.ones_like(t), rcond=None)
    err = np.abs(A @ x - t) / t
    return x, float(np.median(err))


def fit_gemm(records: Sequence[dict[str, Any]], dtype: str, *, act_bytes: int) -> dict[str, float]:
    """Peak and curve of t = launch + 2mnk / (peak * eff): eff = prod d/(d+h) * (c + (1-c) C / (C + ws)), ws the
    operand bytes; grid over (h, C, c), least squares for (launch, 1/peak) at each point."""
    recs = [r for r in records if r["dtype"] == dtype]
    if len(recs) < 3:
        raise ConfigError(f"need at least 3 GEMM timings in {dtype} to fit a rate; got {len(recs)}")
    m, n, k, t = (np.array([r[key] for r in recs], dtype=np.float64) for key in ("m", "n", "k", "s"))
    ws = (m * k + k * n + m * n) * act_bytes
    best: dict[str, float] | None = None
    for h in HALF_DIMS:
        shape_eff = (m / (m + h)) * (n / (n + h)) * (k / (k + h))
        for C in CACHE_BYTES:
            for c in OUT_OF_CACHE:
                eff = shape_eff * ((c + (1 - c) * C / (C + ws)) if C > 0 else 1.0)
                A = np.stack([np.ones_like(t), 2 * m * n * k / eff], axis=1)
                (launch, inv_peak), err = _rel_lstsq(A, t)
                if inv_peak > 0 and (best is None or err < best["median_rel_error"]):
                    best = {"peak": 1.0 / inv_peak, "half_dim": float(h), "launch_s": float(launch),
                            "cache_bytes": float(C), "out_of_cache_efficiency": float(c) if C > 0 else 1.0,
                            "median_rel_error": err}
                if C == 0:
                    break
    if best is None:
        raise ConfigError(f"GEMM timings in {dtype} do not fit a positive rate: re-run the calibration")
    return best


def collective_terms(kind: str, world: int, nbytes: float) -> tuple[float, float]:
    """(algorithm steps, bytes on the busiest link) of moebal's cost model for a collective on one node."""
    from moebal.planner.cost import CostModel

    unit = HardwareProfile(name="unit", gpus_per_node=max(64, world), flops={"fp32": 1.0},
                           gemm=GemmSpec(max_efficiency=1.0, half_dim=0.0), memory_bandwidth=1.0, memory_bytes=1.0,
                           intra=LinkSpec(bandwidth=1.0, latency_s=1.0), inter=LinkSpec(bandwidth=1.0, latency_s=1.0))
    cm = CostModel(unit, "fp32")
    topo = cm.topology(world)
    coll = _collective(cm, topo, kind, world, nbytes)
    steps = sum(p.latency_s for p in coll.phases)
    demand = sum(float(p.nbytes.max()) if p.nbytes.size else 0.0 for p in coll.phases)
    return steps, demand


def _collective(cm: Any, topo: Any, kind: str, world: int, nbytes: float) -> Any:
    ranks = list(range(world))
    if kind == "all_to_all":
        b = np.full((world, world), nbytes / world)
        np.fill_diagonal(b, 0.0)
        return cm.all_to_all(topo, ranks, b)
    if kind == "all_reduce":
        return cm.all_reduce(topo, ranks, nbytes)
    if kind == "broadcast":
        return cm.broadcast(topo, 0, ranks, nbytes)
    if kind == "p2p":
        return cm.p2p(topo, 0, 1, nbytes)
    raise ConfigError(f"cannot fit collective kind {kind!r}")


def fit_collectives(records: Sequence[dict[str, Any]], bandwidth: float) -> dict[str, dict[str, Any]]:
    """Per collective kind and group size: latency per algorithm step and a capacity multiplier on `bandwidth`.

    On a CPU host both depend on how many processes share the cores, so each group size gets its own pair."""
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({r["kind"] for r in records}):
        lat, eff, errs = {}, {}, []
        for w in sorted({int(r["world"]) for r in records if r["kind"] == kind}):
            recs = [r for r in records if r["kind"] == kind and int(r["world"]) == w]
            A, t = [], []
            for r in recs:
                steps, demand = collective_terms(kind, w, float(r["bytes"]))
                A.append([steps, demand / bandwidth])
                t.append(float(r["s"]))
            (alpha, inv_eff), err = _rel_lstsq(np.array(A), np.array(t))
            lat[w], eff[w] = float(alpha), float(1.0 / inv_eff) if inv_eff > 0 else 1.0
            errs.append(err)
        out[kind] = {"latency_by_world": lat, "efficiency_by_world": eff, "median_rel_error": float(np.median(errs))}
    return out


def fit_profile(records: dict[str, list[dict[str, Any]]], *, name: str, description: str, source: Sequence[str],
                calibration: dict[str, Any]) -> HardwareProfile:
    """A profile of this machine: one 'node' holding every rank, links fitted from gloo collectives."""
    flops, gemm_fit = {}, {}
    for dtype in sorted({r["dtype"] for r in records["gemm"]}):
        fit = fit_gemm(records["gemm"], dtype, act_bytes=4 if dtype in ("fp32", "tf32") else 2)
        flops[dtype] = fit.pop("peak")
        gemm_fit[dtype] = fit
    ref = gemm_fit["fp32" if "fp32" in gemm_fit else sorted(gemm_fit)[0]]
    mem_bw = float(np.median([r["bytes"] / r["s"] for r in records["memory"]]))
    p2p = [r for r in records.get("collective", []) if r["kind"] == "p2p"]
    lat, bw = 1e-4, 1e9  # no send/recv timings: a placeholder link (compute-only calibrations)
    if p2p:
        (lat, inv_bw), _ = _rel_lstsq(np.array([[1.0, r["bytes"]] for r in p2p]), np.array([r["s"] for r in p2p]))
        bw = 1.0 / inv_bw if inv_bw > 0 else 1e9
    link = LinkSpec(bandwidth=bw, latency_s=max(lat, 0.0), efficiency=1.0, kind="gloo-loopback")
    coll = fit_collectives(records.get("collective", []), bw)
    specs = {k: CollectiveSpec(latency_s=float(np.median(list(v["latency_by_world"].values()))),
                               efficiency=float(np.median(list(v["efficiency_by_world"].values()))),
                               latency_by_world={str(w): lt for w, lt in v["latency_by_world"].items()},
                               efficiency_by_world={str(w): min(e, 10.0) for w, e in v["efficiency_by_world"].items()})
             for k, v in coll.items()}
    gemm = GemmSpec(max_efficiency=1.0, half_dim=ref["half_dim"], launch_s=max(0.0, ref["launch_s"]),
                    cache_bytes=ref["cache_bytes"], out_of_cache_efficiency=ref["out_of_cache_efficiency"])
    base = HardwareProfile(name=name, description=description, source=tuple(source), device="cpu",
                           gpus_per_node=64, flops=flops, gemm=gemm, memory_bandwidth=mem_bw, memory_efficiency=1.0,
                           memory_bytes=float(calibration.get("memory_bytes", 8e9)), intra=link, inter=link,
                           collectives=specs, calibration={**calibration, "gemm": gemm_fit, "collectives": coll})
    base = _fit_attention(base, records.get("attention", []))
    return _fit_kernels(base, records.get("experts", []), records.get("optimizer", []), records.get("overhead", []))


def _fit_kernels(p: HardwareProfile, experts: Sequence[dict[str, Any]], optimizer: Sequence[dict[str, Any]],
                 overhead: Sequence[dict[str, Any]] = ()) -> HardwareProfile:
    """grouped_gemm_efficiency: the expert kernel's GEMM time at efficiency 1 over its measured time less the
    modelled elementwise work; op_overhead_s: the slope of tiny autograd op chains (one forward and one backward
    kernel per op); optimizer_bytes_per_param: AdamW seconds x memory bandwidth / parameters."""
    from moebal.planner.cost import CostModel, ModelShape

    ratios = []
    plain = dataclasses.replace(p, grouped_gemm_efficiency=1.0)
    for r in experts:
        cm = CostModel(plain, r["dtype"])
        shape = ModelShape(dim=r["dim"], n_layers=1, n_heads=1, n_kv_heads=1, head_dim=r["dim"], ffn_dim=r["ffn"],
                           vocab_size=1, num_experts=len(r["rows"]), expert_ffn_dim=r["ffn"])
        rows = np.asarray(r["rows"], dtype=np.float64)
        total = cm.experts_s(shape, rows) + cm.experts_s(shape, rows, True)
        gemm = sum(float(np.sum(cm.linear_s(rows, a, b, bw))) for a, b in ((r["ffn"], r["dim"]), (r["ffn"], r["dim"]),
                                                                          (r["dim"], r["ffn"])) for bw in (False, True))
        elem = total - gemm
        if r["s"] > elem:
            ratios.append(gemm / (r["s"] - elem))
    if ratios:
        p = dataclasses.replace(p, grouped_gemm_efficiency=float(min(max(np.median(ratios), 0.02), 1.0)),
                                calibration={**p.calibration, "grouped_gemm_ratios": [float(r) for r in ratios]})
    if overhead:
        by_n = {int(r["ops"]): r["s"] for r in overhead}
        lo, hi = min(by_n), max(by_n)
        if hi > lo:
            # each chained op is one forward and one backward kernel
            p = dataclasses.replace(p, op_overhead_s=float(max((by_n[hi] - by_n[lo]) / (hi - lo) / 2, 0.0)))
    if optimizer:
        rate = p.memory_bandwidth * p.memory_efficiency
        per = [max(r["s"] - 10 * r.get("tensors", 0) * p.op_overhead_s, 0.0) * rate / r["params"] for r in optimizer]
        p = dataclasses.replace(p, optimizer_bytes_per_param=float(max(np.median(per), 1.0)))
    return p


def _fit_attention(p: HardwareProfile, records: Sequence[dict[str, Any]]) -> HardwareProfile:
    """attention_efficiency (measured SDPA forward vs the GEMM model of QK^T and PV, causal share) and
    attention_backward_factor (measured backward / forward): medians over the timed shapes."""
    from moebal.planner.cost import CostModel

    eff, back = [], []
    for r in records:
        cm = CostModel(p, r["dtype"])
        per_head = 2 * cm.gemm_s(r["seq"], r["seq"], r["head_dim"]) - 2 * p.gemm.launch_s
        model = p.causal_attention_factor * r["batch"] * r["heads"] * per_head
        if model > 0:
            eff.append(model / max(r["s"] - p.gemm.launch_s, 1e-9))
        if "fwd_bwd_s" in r:
            back.append(r["fwd_bwd_s"] / r["s"] - 1.0)
    if eff:
        p = dataclasses.replace(p, attention_efficiency=float(min(max(np.median(eff), 1e-3), 10.0)))
    if back:
        p = dataclasses.replace(p, attention_backward_factor=float(max(np.median(back), 0.5)))
    return p
