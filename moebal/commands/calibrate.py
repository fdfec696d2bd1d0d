"""`moebal calibrate`: measure this machine (GEMMs by shape and layout, elementwise kernels, causal SDPA forward
and backward, gloo collectives at 2 to 4 ranks) and write a hardware profile the cost model and simulator use
like any other.

Every measurement is a *probe*: a named callable with the facts the fit needs. Probes run round-robin (every
round calls each probe once), so a shared machine's slow drifts hit them all alike, and each figure is the
median of its rounds. Compute probes run in this process with `--threads` intra-op threads (a modelled
"device" is one process); collective probes run on `world` spawned gloo ranks of one thread each, a round
starting with a barrier and its time being the slowest rank's. The fit is moebal.planner.hardware_fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moebal.errors import ConfigError
from moebal.fileio import read_json

GEMM_SHAPES = [(m, n, k) for m in (16, 64, 256, 1024, 4096) for n, k in ((128, 128), (512, 256), (256, 768),
                                                                          (1024, 1024), (2048, 512))]
QUICK_GEMM = [(m, n, k) for m in (16, 256, 2048) for n, k in ((256, 256), (1024, 512))]
ATTN_SHAPES = [(1, 4, 256, 64), (2, 8, 512, 64), (4, 4, 128, 64)]
EXPERT_SHAPES = [(8, 2048, 256, 512), (16, 2048, 128, 256), (4, 1024, 384, 1024)]
COLL_KINDS = ("p2p", "all_to_all", "all_reduce", "broadcast")

Probe = tuple[dict[str, Any], Callable[[], Any]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="profile to write (YAML; default: NAME.yaml in the hardware profiles' "
                   "folder, configs/hardware/ of the installed package, where `--cluster NAME` finds it)")
    p.add_argument("--name", default="local", help="profile name")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of the measured process")
    p.add_argument("--worlds", default="2,3,4", help="gloo group sizes to measure collectives at")
    p.add_argument("--sizes", default="65536,262144,1048576,4194304,16777216",
                   help="collective payload bytes per rank")
    p.add_argument("--repeats", type=int, default=7, help="rounds of every probe (the median is kept)")
    p.add_argument("--quick", action="store_true", help="fewer shapes, sizes and rounds (a smoke run)")
    p.add_argument("--records", default=None, metavar="FILE", help="also write the raw timings as JSON")
    p.add_argument("--from-records", default=None, metavar="FILE", help="refit from timings written by --records "
                   "instead of measuring")


def run(args: argparse.Namespace) -> int:
    import torch

    from moebal.fileio import output_path, write_text_whole
    from moebal.kernels.bench import environment
    from moebal.planner.hardware import PROFILE_DIR, dump_profile
    from moebal.planner.hardware_fit import fit_profile

    if args.threads < 1 or args.repeats < 1:
        raise ConfigError(f"--threads and --repeats must be >= 1; got {args.threads}, {args.repeats}")
    worlds = _counts(args.worlds, "--worlds", least=2, what="gloo group sizes (a collective needs two ranks)")
    sizes = _counts(args.sizes, "--sizes", least=1, what="payload bytes per rank")
    out = args.out or str(PROFILE_DIR / f"{args.name}.yaml")
    for flag, path in (("--out", out), ("--records", args.records)):  # named before minutes of measuring
        if path:
            output_path(path, flag)
    records: dict[str, Any] | None = _read_records(Path(args.from_records)) if args.from_records else None
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else args.repeats
    if args.quick:
        worlds, sizes = worlds[:2], sorted({sizes[0], sizes[-1]})
    t0 = time.perf_counter()
    if records is None:
        compute = measure_compute(repeats, args.quick)
        collective = [r for w in worlds for r in measure_collectives(w, sizes, repeats)]
        # where and how the timings were taken travels with them: a refit names that machine, not its own
        meta = {**environment(), "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "repeats": repeats, "worlds": worlds, "sizes": sizes, "measure_s": round(time.perf_counter() - t0, 1)}
        records = {**compute, "collective": collective, "meta": meta}
    if args.records:
        write_text_whole(args.records, json.dumps(records, indent=1))
    taken = records.get("meta")
    if not isinstance(taken, dict) or not all(k in taken for k in _SOURCE_KEYS):  # records of an older calibrate
        taken = {"recorded": f"refit from {args.from_records}; the machine and settings it was measured with are not "
                             "recorded"}
    what = "this machine" if args.from_records is None else f"the machine of {args.from_records}"
    try:
        prof = fit_profile(records, name=args.name, description=f"{what}, calibrated (CPU processes on gloo)",
                           source=[_source(taken, args.from_records)], calibration=taken)
    except (KeyError, TypeError, ValueError) as e:
        if not args.from_records:
            raise  # measured here: a bug, not bad input
        raise ConfigError(f"--from-records {args.from_records}: its timings do not fit a profile ({type(e).__name__}: "
                          f"{e}): give a file `moebal calibrate --records` wrote") from None
    dump_profile(prof, out, header="Written by `moebal calibrate`; re-run it to refresh. Figures are fitted "
                 "to\nmicro-benchmarks of this machine, not datasheet values.")
    json.dump(summary(prof, out), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


def _counts(text: str, flag: str, least: int, what: str) -> list[int]:
    """A comma list of integers of at least `least`; a ConfigError naming `flag` otherwise."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise ConfigError(f"{flag}: expected a comma list of {what}, each at least {least}; got {text!r}")
    return values


def _read_records(path: Path) -> dict[str, Any]:
    """Timings `--records` wrote: a JSON object with at least the GEMM and memory probes the fit needs."""
    records = read_json(path, "--from-records")
    if not (isinstance(records, dict) and records.get("gemm") and records.get("memory")):
        raise ConfigError(f"--from-records {path}: not the timings `moebal calibrate --records` writes (a JSON "
                          f"object with 'gemm' and 'memory' records)")
    return records


_SOURCE_KEYS = ("cpu", "logical_cores", "threads", "torch", "date", "repeats")


def _source(meta: dict[str, Any], refit_from: str | None) -> str:
    if "recorded" in meta:
        return str(meta["recorded"])
    how = (f"measured by `moebal calibrate` on {meta['cpu']} ({meta['logical_cores']} cores, {meta['threads']} "
           f"thread(s) per process, torch {meta['torch']}, {meta['date']}): medians of {meta['repeats']} rounds")
    return how if refit_from is None else f"{how}; refit from {refit_from}"


def summary(prof: Any, path: str) -> dict[str, Any]:
    cal = prof.calibration
    return {"profile": path, "flops": prof.flops, "memory_bandwidth": prof.memory_bandwidth,
            "link_bandwidth": prof.intra.bandwidth, "link_latency_s": prof.intra.latency_s,
            "gemm": dataclasses.asdict(prof.gemm), "attention_efficiency": prof.attention_efficiency,
            "attention_backward_factor": prof.attention_backward_factor,
            "fit_errors": {**{f"gemm_{k}": v["median_rel_error"] for k, v in cal.get("gemm", {}).items()},
                           **{k: v["median_rel_error"] for k, v in cal.get("collectives", {}).items()}}}


# ---- probes --------------------------------------------------------------------------------------------------
def _dtype(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def gemm_probes(dtype: str, shapes: Sequence[tuple[int, int, int]]) -> dict[str, Probe]:
    """A linear layer's three GEMMs at each (tokens m, out n, in k): forward x W^T, dgrad dy W, wgrad dy^T x,
    each recorded under its own (m, n, k) (rows, columns, inner dimension)."""
    import torch
    import torch.nn.functional as F

    out: dict[str, Probe] = {}
    for m, n, k in shapes:
        x = torch.randn(m, k, dtype=_dtype(dtype))
        w = torch.randn(n, k, dtype=_dtype(dtype))
        dy = torch.randn(m, n, dtype=_dtype(dtype))
        for layout, fn, dims in (("fwd", lambda x=x, w=w: F.linear(x, w), (m, n, k)),
                                 ("dgrad", lambda dy=dy, w=w: dy @ w, (m, k, n)),
                                 ("wgrad", lambda dy=dy, x=x: dy.t() @ x, (n, k, m))):
            meta = {"dtype": dtype, "layout": layout, "m": dims[0], "n": dims[1], "k": dims[2]}
            out[f"gemm {dtype} {layout} {m}x{n}x{k}"] = (meta, fn)
    return out


def memory_probes() -> dict[str, Probe]:
    """Elementwise kernels a layer runs (copy, multiply, SiLU) on 1M and 4M floats: bytes read + written."""
    import torch
    import torch.nn.functional as F

    out: dict[str, Probe] = {}
    for numel in (1 << 20, 1 << 22):
        a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
        for op, fn, nbytes in (("copy", lambda a=a, c=c: c.copy_(a), 8 * numel),
                               ("mul", lambda a=a, b=b, c=c: torch.mul(a, b, out=c), 12 * numel),
                               ("silu", lambda a=a: F.silu(a), 8 * numel)):
            out[f"mem {op} {numel}"] = ({"op": op, "bytes": nbytes}, fn)
    return out


def attention_probes(dtype: str, shapes: Sequence[tuple[int, int, int, int]]) -> dict[str, Probe]:
    """Causal SDPA forward, and forward + backward."""
    import torch
    import torch.nn.functional as F

    out: dict[str, Probe] = {}
    for b, h, t, d in shapes:
        q, k, v = (torch.randn(b, h, t, d, dtype=_dtype(dtype), requires_grad=True) for _ in range(3))

        def fwd(q: Any = q, k: Any = k, v: Any = v) -> None:
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd(q: Any = q, k: Any = k, v: Any = v) -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        meta = {"dtype": dtype, "batch": b, "heads": h, "seq": t, "head_dim": d}
        out[f"sdpa {dtype} {b}x{h}x{t}x{d}"] = ({**meta, "pass": "fwd"}, fwd)
        out[f"sdpa-bwd {dtype} {b}x{h}x{t}x{d}"] = ({**meta, "pass": "fwd_bwd"}, fwd_bwd)
    return out


def expert_probes(dtype: str, shapes: Sequence[tuple[int, int, int, int]]) -> dict[str, Probe]:
    """moebal's grouped SwiGLU expert kernel, forward + backward, on (experts, rows, dim, ffn) with rows spread
    over the experts at random (seeded)."""
    import torch

    from moebal.kernels.dispatch import DispatchPlan, make_plan
    from moebal.kernels.expert_ffn import KernelName, auto_kernel, swiglu_experts

    out: dict[str, Probe] = {}
    for E, N, D, Fh in shapes:
        gen = torch.Generator().manual_seed(0)
        plan = make_plan(torch.randint(0, E, (N, 1), generator=gen), None, E)
        x = torch.randn(N, D, dtype=_dtype(dtype), requires_grad=True)
        ws = [(torch.randn(E, a, b) * 0.02).to(_dtype(dtype)).requires_grad_() for a, b in ((Fh, D), (Fh, D), (D, Fh))]
        kernel = auto_kernel(torch.device("cpu"), D, Fh, _dtype(dtype))

        def step(x: torch.Tensor = x, ws: list[torch.Tensor] = ws, plan: DispatchPlan = plan,
                 kernel: KernelName = kernel) -> None:
            swiglu_experts(x, ws[0], ws[1], ws[2], plan, kernel).sum().backward()

        meta = {"dtype": dtype, "dim": D, "ffn": Fh, "rows": plan.host_counts()}
        out[f"experts {dtype} E{E} N{N} D{D} F{Fh}"] = (meta, step)
    return out


def optimizer_probes(params: int = 1 << 21) -> dict[str, Probe]:
    """One AdamW step (PyTorch's default implementation) over `params` fp32 parameters in 8 tensors."""
    import torch

    ps = [torch.nn.Parameter(torch.randn(params // 8)) for _ in range(8)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(ps, lr=1e-4)
    return {f"adamw {params}": ({"params": params, "tensors": len(ps)}, opt.step)}


def overhead_probes(lengths: Sequence[int] = (1, 33)) -> dict[str, Probe]:
    """Chains of tiny autograd multiplies, forward + backward: the slope is the fixed cost per kernel."""
    import torch

    x = torch.randn(64, requires_grad=True)
    out: dict[str, Probe] = {}
    for n in lengths:
        def chain(n: int = n) -> None:
            y = x
            for _ in range(n):
                y = y * 1.0001
            y.sum().backward()

        out[f"overhead {n}"] = ({"ops": n}, chain)
    return out


def compute_probes(quick: bool = False, dtypes: Sequence[str] = ("fp32", "bf16")) -> dict[str, Probe]:
    probes: dict[str, Probe] = {}
    for dtype in dtypes:
        probes.update(gemm_probes(dtype, QUICK_GEMM if quick else GEMM_SHAPES))
        probes.update(attention_probes(dtype, ATTN_SHAPES[:1] if quick else ATTN_SHAPES))
        probes.update(expert_probes(dtype, EXPERT_SHAPES[:1] if quick else EXPERT_SHAPES))
    probes.update(memory_probes())
    probes.update(optimizer_probes())
    probes.update(overhead_probes())
    return probes


def compute_records(probes: dict[str, Probe], medians: dict[str, float]) -> dict[str, list[dict[str, Any]]]:
    """Fit records (see hardware_fit) from probe facts and median seconds."""
    rec: dict[str, list[dict[str, Any]]] = {"gemm": [], "memory": [], "attention": [], "experts": [],
                                            "optimizer": [], "overhead": []}
    sdpa: dict[tuple[object, ...], dict[str, Any]] = {}  # keyed by (dtype, batch, heads, seq, head_dim)
    for name, (meta, _) in probes.items():
        if name not in medians:
            continue
        t = medians[name]
        if name.startswith("gemm"):
            rec["gemm"].append({**meta, "s": t})
        elif name.startswith("mem"):
            rec["memory"].append({**meta, "s": t})
        elif name.startswith("experts"):
            rec["experts"].append({**meta, "s": t})
        elif name.startswith("adamw"):
            rec["optimizer"].append({**meta, "s": t})
        elif name.startswith("overhead"):
            rec["overhead"].append({**meta, "s": t})
        elif name.startswith("sdpa"):
            key = tuple(meta[k] for k in ("dtype", "batch", "heads", "seq", "head_dim"))
            entry = sdpa.setdefault(key, {k: v for k, v in meta.items() if k != "pass"})
            entry["s" if meta["pass"] == "fwd" else "fwd_bwd_s"] = t
    rec["attention"] = [e for e in sdpa.values() if "s" in e and "fwd_bwd_s" in e]
    return rec


def round_robin(fns: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1,
                sync: Callable[[], Any] | None = None) -> dict[str, list[float]]:
    """Seconds of each fn per round; every round calls each fn once, in a rotated order (the shared timing
    helper; `sync` runs before each timed call, outside the timed region). The probes run on the CPU."""
    from moebal.kernels.bench import sample_interleaved

    return sample_interleaved(fns, warmup=warmup, repeats=rounds, before=sync)[0]


def measure_compute(rounds: int, quick: bool) -> dict[str, list[dict[str, Any]]]:
    probes = compute_probes(quick)
    samples = round_robin({k: fn for k, (_, fn) in probes.items()}, rounds)
    return compute_records(probes, {k: statistics.median(v) for k, v in samples.items()})


def collective_probes(rank: int, world: int, sizes: Sequence[int],
                      kinds: Sequence[str] = COLL_KINDS) -> dict[str, Probe]:
    import torch

    out: dict[str, Probe] = {}
    for nbytes in sizes:
        n = max(world, nbytes // 4 // world * world)
        x, y = torch.ones(n), torch.empty(n)
        for kind in kinds:
            meta = {"kind": kind, "world": world if kind != "p2p" else 2, "bytes": 4 * n}
            out[f"coll {kind} w{world} {4 * n}"] = (meta, _collective_fn(kind, rank, x, y))
    return out


def _collective_fn(kind: str, rank: int, x: Any, y: Any) -> Callable[[], Any]:
    import torch.distributed as dist

    if kind == "p2p":
        if rank > 1:
            return lambda: None  # ranks outside the pair idle
        return (lambda: dist.send(x, 1)) if rank == 0 else (lambda: dist.recv(y, 0))
    if kind == "all_to_all":
        return lambda: dist.all_to_all_single(y, x)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    return lambda: dist.broadcast(x, 0)


def synced_round_robin(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """round_robin on every rank of the default group: a barrier starts each call, a call lasts as long as its
    slowest rank (an all-reduce of the samples at the end)."""
    import torch
    import torch.distributed as dist

    samples = round_robin(fns, rounds, sync=dist.barrier)
    names = list(samples)
    t = torch.tensor([samples[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {n: t[i].tolist() for i, n in enumerate(names)}


def _collective_worker(rank: int, world: int, sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    probes = collective_probes(rank, world, sizes)
    samples = synced_round_robin({k: fn for k, (_, fn) in probes.items()}, rounds)
    return [{**meta, "s": statistics.median(samples[k])} for k, (meta, _) in probes.items()]


def measure_collectives(world: int, sizes: Sequence[int], rounds: int) -> list[dict[str, Any]]:
    from moebal.distributed.testing import run_ranks

    per_rank: list[list[dict[str, Any]]] = run_ranks(_collective_worker, world, list(sizes), rounds, timeout_s=900.0)
    return per_rank[0]
