#!/usr/bin/env python
"""The GPU check: one prepared script that shows moebal's CUDA path correct on a real GPU, in at most 8 minutes
on one H100, with nothing to edit first.

    python scripts/gpu_check.py --json out.json                        # a GPU machine (CUDA found: used)
    python scripts/gpu_check.py --device cpu --quick --json out.json   # the CI form (tests/integration)

It needs torch, numpy and pyyaml; moebal need not be installed (the repository root is put on sys.path, and
the training runs are `python -m moebal.cli` with PYTHONPATH set). Checks, each independent (an exception is
recorded as that check's failure with the traceback's last lines, and the next check runs):

1. env: versions (torch, CUDA, NCCL, driver), GPU name and capability, CPU model, bf16 support.
2. nccl_smoke: a one-rank `cpu:gloo,cuda:nccl` process group under torchrun (this script re-run as a worker):
   all-reduces of a CUDA and a CPU tensor on the one default group, then a `CommScheduler` round trip: an
   uneven all-to-all (fp32 and bf16), a scheduled all-reduce, and a chunked gradient all-reduce (`GradSync`).
3. grouped_gemm: `swiglu_experts(..., "grouped_mm")` against `reference_experts` (fp32 from the same bf16
   inputs) at unaligned counts: forward, input gradient and every expert's weight gradients.
4. moe_layer: `MoELayer` on the device against the same weights on CPU: fp32 `loop` and bf16 autocast
   `grouped_mm`, dropless, capacity drops and adaptive top-k; outputs and every gradient; host syncs per
   forward and backward (CUDA sync debug mode and `moebal.sync.audit`).
5. train_resume: `moebal train --nproc 1` for 100 steps, `--resume` to 120 in a copy of its directory, and a
   straight 120-step run: the loss falls, steps 101-120 are bitwise the straight run's, tokens/s.
6. expert_kernel_vs_dense: the expert kernel's forward + backward against one dense SwiGLU over the same rows,
   balanced and 4x-skewed routing, in TFLOP/s and as a multiple of the dense time (CUDA events).
7. recompute: `train.recompute` none/moe/attention/full on the device (one model per mode from one seed): fp32
   loss and every gradient bitwise equal to none (deterministic algorithms on CUDA; none against itself shows
   whether the device's kernels allow it), then activation peak (allocator peak over a step minus what was
   allocated before it) and step time (CUDA events) in bf16 autocast, modes rotated per round, every round kept.
8. memory_plan: `moebal train --nproc 1` for a few steps at 5 layouts (precision, recompute, sequence length)
   against `moebal.planner.memory.plan_memory` with the h100 profile's runtime and slack assumptions at this
   card's capacity: measured peak = (used - reserved after the run: the CUDA context and libraries) + the
   allocator's peak reserved bytes; also the measured runtime and slack against the profile's (2.0 GB assumed;
   slack 0.12, fitted on earlier runs of these same 5 layouts, so the peak error is in sample), and
   the simulator's one-rank step time on the h100 profile against the measured median step (balanced routing).
9. grad_accum: `train.grad_accum` 1, 2 and 4 through the trainer's step code on the device: fp32 loss and every
   gradient within 1e-5 of one pass (no balancing loss), then the bf16 activation peak and pass time per count.
10. sparse_attention: the block-sparse attention kernel on every path that trains on the device (CUDA: flex, the
   default, and masked) against dense attention under the same block mask (output, dq, dk, dv; bf16 against fp32
   on CUDA) at densities 0.5 and 0.25; fwd+bwd time (block selection included) over the dense causal SDPA call at
   densities 0.75-0.1 (CUDA events; 4,096 tokens, 16 query / 4 key-value heads of 64, blocks of 128), the masked
   path's grouped and expanded forms, activation peaks, which SDPA backends take each call form, the flex path's
   parts (selection, block mask, kernel) and rows of 8,192-32,768 tokens, and the sparse_attention scheme's
   start-up fit of its cost constants (`costs: measure`) on the device.
11. sparse_attention_train: `moebal train --dynamism sparse_attention` on the device as a one-stage pipeline, the
   random walk's densities (0.1-0.5) against the same run held at density 1, rows of 16,384 tokens: finite
   losses, the densities applied, each run's median step time.
12. pipeline_syncs: a one-stage pipeline (the `moe` and `sparse_attention` schemes, grouped_mm experts) in this
   process: host syncs of one step's schedule (the engine's F and B ops: budget 0 with the `moe` scheme on
   one device; sparse attention's are reported) and of the whole step, CUDA sync debug mode and
   `moebal.sync.audit` (`tests/distributed/test_pipeline_syncs.py` counts the Python-level reads on CPU).
13. padded_schemes: MoD and early exit on padded rows (planned micro-batching's `ROW_TOKENS`) on the device
   against the CPU (MoD's selection equal, its output within fp32 tolerance, no host sync; early exit's survival
   counts equal, one named read per layer), and pruning's global top-k (the radix select) on the device against
   the single-process top-k, bit for bit.
14. generate: the KV-cached decoder on the device for grouped-query MoE attention with a window, MLA (latent and
   per-head caches) and MoD routed by its causal predictors: fp32 logits against the model's forward and against
   the CPU's, MLA's two caches against each other in bf16, one decode step's host syncs, and decode tokens/s of
   the default model with the cache and by the whole prefix.

On CPU the CUDA-only parts are skipped, each with "skipped: why" in its check's `skipped` list; everything
else runs at small shapes. The exit code is 1 when any check failed, 2 on bad arguments.

Shape legend: T tokens, N dispatched rows (grouped by expert), D model dim, F expert hidden dim, E experts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import linecache
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

BUDGET_S = 480.0
"""The whole check's budget on one H100 (8 minutes): subprocesses get at most what is left of it."""

# Tolerances, stated once, on the error relative to the reference's norm and to its largest magnitude. bf16
# kernels round every intermediate (both projections, silu, the product) to 8 mantissa bits (relative 2^-9 per
# rounding), so they differ from an fp32 evaluation of the same bf16 inputs, or from a bf16 CPU run, by a few
# 1e-3 in norm (4e-3 measured on an H200 at D=4096, F=14336); the bounds leave a margin of a few x and still
# catch a wrong row, offset or group (errors of order 1). fp32 against fp64, or CUDA fp32 (TF32 off) against
# CPU fp32: summation order only (below 1e-6 measured).
TOL = {
    "bf16": {"rel_norm": 1e-2, "rel_max": 3e-2},
    "fp32": {"rel_norm": 1e-5, "rel_max": 1e-4},
}
MAX_ROUTING_MISMATCH = 0.01
"""moe_layer: the largest share of tokens whose routing may differ between the devices (near-ties of router
scores rounded differently); those tokens are left out of the comparison, and their count is reported."""


@dataclass
class Ctx:
    device: torch.device
    quick: bool
    deadline: float
    workdir: Path

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        return self.deadline - time.perf_counter()


# ---- small helpers ---------------------------------------------------------------------------------------------

def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _env() -> dict[str, str]:
    """The environment of a subprocess: moebal importable from the repository root."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


def _errs(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Error of `a` against the reference `b`: max abs, and relative to the reference's max and norm."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    d = (a - b).abs()
    max_abs, max_ref = float(d.max()) if d.numel() else 0.0, float(b.abs().max()) if b.numel() else 0.0
    norm_d, norm_b = float(d.norm()), float(b.norm())
    return {"max_abs": max_abs, "max_ref": max_ref, "rel_max": max_abs / max_ref if max_ref else max_abs,
            "rel_norm": norm_d / norm_b if norm_b else norm_d}


def _within(e: dict[str, float], tol: dict[str, float]) -> bool:
    return e["rel_norm"] <= tol["rel_norm"] and e["rel_max"] <= tol["rel_max"]


def _round(x: Any) -> Any:
    """Four significant digits; NaN as null (the report is plain JSON)."""
    if isinstance(x, float):
        return float(f"{x:.4g}") if x == x else None
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


def _free(ctx: Ctx) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


# ---- 1. env ----------------------------------------------------------------------------------------------------

def _driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        r = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=15)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=ROOT)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _source() -> dict[str, Any]:
    """The commit the tree is at and how many tracked files differ from it (a run may test uncommitted work)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "HEAD"), "modified_files": None if status is None else
            len(status.splitlines())}


def check_env(ctx: Ctx) -> dict[str, Any]:
    from moebal.kernels.bench import environment

    res: dict[str, Any] = {"ok": True, "env": environment(), "torch_cuda": torch.version.cuda,
                           "python": platform.python_version(), "cuda_available": torch.cuda.is_available(),
                           "moebal_source": _source(), "skipped": []}
    if not ctx.cuda:
        res["skipped"].append("gpu, nccl, driver: skipped: no CUDA device in use (--device cpu)")
        res["summary"] = f"torch {torch.__version__}, CPU {res['env']['cpu']}"
        return res
    props = torch.cuda.get_device_properties(ctx.device)
    nccl = torch.cuda.nccl.version()
    res.update(gpu=props.name, capability=".".join(map(str, torch.cuda.get_device_capability(ctx.device))),
               gpu_memory_gib=round(props.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count(),
               nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
               bf16_supported=torch.cuda.is_bf16_supported(), driver=_driver(),
               allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    res["summary"] = (f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {res['nccl']}, {props.name} "
                      f"sm{res['capability']}, driver {res['driver']}")
    return res


# ---- 2. nccl_smoke (a torchrun worker) ------------------------------------------------------------------------

def _a2a_rows(src: int, dst: int) -> int:
    """Rows rank `src` sends rank `dst` in the smoke all-to-all: uneven in both ranks."""
    return 3 + src + 2 * dst


def _a2a_block(src: int, dst: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    n = _a2a_rows(src, dst)
    rows_N1 = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    cols_1C = torch.arange(5, dtype=torch.float64).unsqueeze(0) * 0.5
    return (src * 1000 + dst * 100 + rows_N1 + cols_1C).to(dtype).to(device)


def _smoke_a2a(sched: Any, rank: int, world: int, dev: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import torch.distributed as dist

    inp = torch.cat([_a2a_block(rank, j, dtype, dev) for j in range(world)])
    want = torch.cat([_a2a_block(j, rank, dtype, dev) for j in range(world)])
    out = torch.full_like(want, float("nan"))
    in_splits = [_a2a_rows(rank, j) for j in range(world)]
    out_splits = [_a2a_rows(j, rank) for j in range(world)]
    h = sched.all_to_all(out, inp, out_splits, in_splits, dist.group.WORLD, name=f"gpu_check a2a {dtype}")
    h.wait()  # CUDA: a stream wait; the comparison below reads the result on the compute stream
    return {"ok": bool(torch.equal(out, want)), "rows_in": in_splits, "rows_out": out_splits}


def _smoke_grads(sched: Any, world: int, dev: torch.device) -> dict[str, Any]:
    import torch.distributed as dist

    from moebal.scheduler import GradGroup, GradSync

    torch.manual_seed(0)  # the same model and data on every rank: the mean over ranks is each rank's gradient
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).to(dev)
    x = torch.randn(64, 16, device=dev)
    model(x).square().mean().backward()
    want = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    gs = GradSync(sched, [GradGroup("dp", list(model.parameters()), dist.group.WORLD, float(world))],
                  chunk_bytes=256)
    worst = 0.0
    try:
        for _ in range(2):  # two steps: buffers allocated on the first, reused on the second
            gs.begin_step()
            model(x).square().mean().backward()
            gs.finish()
            for p, w in zip(model.parameters(), want):
                worst = max(worst, float((p.grad - w).abs().max()))
                p.grad = None
    finally:
        gs.close()
    return {"ok": worst <= 1e-6, "chunks": gs.num_chunks, "max_abs_err": worst}


def _smoke_collectives(rank: int, world: int, dev: torch.device, res: dict[str, Any]) -> None:
    import torch.distributed as dist

    total = world * (world + 1) / 2  # sum over ranks of (rank + 1)
    if dev.type == "cuda":
        t = torch.arange(4, dtype=torch.float32, device=dev) * (rank + 1)
        dist.all_reduce(t)
        res["allreduce_cuda"] = bool(torch.equal(t.cpu(), torch.arange(4, dtype=torch.float32) * total))
    else:
        res["skipped"].append("allreduce_cuda: skipped: no CUDA device (gloo only)")
    c = torch.arange(4, dtype=torch.float64) * (rank + 1)  # a CPU tensor on the same default group: gloo
    dist.all_reduce(c)
    res["allreduce_cpu"] = bool(torch.equal(c, torch.arange(4, dtype=torch.float64) * total))


def _smoke_worker(device_type: str, out_path: Path) -> int:
    """One rank of the smoke test (under torchrun): writes its findings to `out_path` (rank 0)."""
    import datetime as dt

    import torch.distributed as dist

    from moebal.scheduler import CommScheduler

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = device_type == "cuda"
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    res: dict[str, Any] = {"world_size": world, "skipped": []}
    try:
        if cuda:
            torch.cuda.set_device(dev)
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        dist.init_process_group(backend, timeout=dt.timedelta(seconds=90), device_id=dev if cuda else None)
        res["backend"] = str(dist.get_backend())
        with contextlib.suppress(AttributeError, RuntimeError):
            res["backend_config"] = str(dist.get_backend_config())
        _smoke_collectives(rank, world, dev, res)  # also creates and warms the communicators
        sched = CommScheduler("lina", rank=rank, device=dev, timeout_s=60.0)
        res["completion"] = type(sched.completion).__name__
        res["stream_wait"] = bool(getattr(sched.completion, "stream_wait", False))
        try:
            res["a2a_fp32"] = _smoke_a2a(sched, rank, world, dev, torch.float32)
            res["a2a_bf16"] = _smoke_a2a(sched, rank, world, dev, torch.bfloat16)
            s = sched.all_reduce(torch.full((3,), float(rank + 1), device=dev), dist.group.WORLD, name="gpu_check")
            res["sched_allreduce"] = bool(torch.equal(s.cpu(), torch.full((3,), world * (world + 1) / 2)))
            res["grad_sync"] = _smoke_grads(sched, world, dev)
        finally:
            sched.close()
        if cuda:
            torch.cuda.synchronize(dev)
        res["ok"] = not _smoke_failed_parts(res)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which records the check as failed
        res.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], traceback=_tail(traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        out_path.write_text(json.dumps(res, indent=1), encoding="utf-8")
    return 0 if res["ok"] else 1


SMOKE_PARTS = ("allreduce_cpu", "allreduce_cuda", "a2a_fp32", "a2a_bf16", "sched_allreduce", "grad_sync")


def _smoke_failed_parts(res: dict[str, Any]) -> list[str]:
    """The smoke worker's parts that did not pass (a part missing from the result counts as failed, except the
    CUDA all-reduce on a CPU run, which is listed as skipped)."""
    bad = []
    for name in SMOKE_PARTS:
        v = res.get(name, True if name == "allreduce_cuda" else None)
        if not (v.get("ok") if isinstance(v, dict) else v):
            bad.append(name)
    return bad


def _run_smoke(ctx: Ctx, out: Path) -> tuple[dict[str, Any] | None, subprocess.CompletedProcess[str]]:
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", __file__,
           "--worker", "smoke", "--device", ctx.device.type, "--worker-out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(),
                       timeout=max(30.0, min(180.0, ctx.left())))
    return (json.loads(out.read_text(encoding="utf-8")) if out.exists() else None), r


def check_nccl_smoke(ctx: Ctx) -> dict[str, Any]:
    """Every failure says what failed: the worker's exception, the parts whose results were wrong, or the
    launcher's exit code with its stderr. One case is run a second time: every part passed in the worker but
    torchrun exited non-zero (its own rendezvous shutdown, after the worker's result was written); both exits
    are kept in `launcher_exits`, and a second non-zero exit fails the check. A wrong result is never re-run."""
    out = ctx.workdir / "smoke.json"
    res, r = _run_smoke(ctx, out)
    exits = [r.returncode]
    if res is not None and r.returncode != 0 and res.get("ok") and not _smoke_failed_parts(res):
        first_stderr = _tail(r.stderr)
        res, r = _run_smoke(ctx, out)
        exits.append(r.returncode)
        if res is not None:
            res["first_launch_stderr_tail"] = first_stderr
    if res is None:
        return {"ok": False, "error": f"the torchrun worker wrote no result (exit {r.returncode})",
                "stderr_tail": _tail(r.stderr), "launcher_exits": exits}
    res["launcher_exits"] = exits
    bad = _smoke_failed_parts(res)
    if r.returncode != 0 or bad or not res.get("ok"):
        res["ok"] = False
        res["stderr_tail"] = _tail(r.stderr)
        why = res.get("error") or (f"wrong results in: {', '.join(bad)}" if bad else
                                   f"torchrun exited {r.returncode} after the worker passed")
        last = r.stderr.strip().splitlines()[-1][:300] if r.stderr.strip() else "(no stderr)"
        res["error"] = f"{why}; torchrun exit {r.returncode}; last stderr line: {last}"
    if ctx.cuda and res.get("ok") and not res.get("stream_wait"):
        res.update(ok=False, error=f"the scheduler on CUDA chose {res.get('completion')}, not a stream wait")
    res["summary"] = (f"{res.get('backend_config', res.get('backend'))}: all-reduce cuda/cpu, "
                      f"scheduler a2a fp32/bf16, grad sync ({res.get('grad_sync', {}).get('chunks')} chunks), "
                      f"completion {res.get('completion')}")
    return res


# ---- 3. grouped_gemm ------------------------------------------------------------------------------------------

def _stacked(E: int, D: int, F_: int, dtype: torch.dtype, dev: torch.device) -> list[torch.Tensor]:
    """w1, w3 [E, F, D] and w2 [E, D, F], scaled so every activation stays of order 1."""
    ws = [torch.randn(E, F_, D, device=dev) * D**-0.5, torch.randn(E, F_, D, device=dev) * D**-0.5,
          torch.randn(E, D, F_, device=dev) * F_**-0.5]
    return [w.to(dtype).requires_grad_(True) for w in ws]


def _plan_for(counts: list[int], dev: torch.device) -> Any:
    from moebal.kernels import make_plan

    ids_N = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return make_plan(ids_N.unsqueeze(1).to(dev), None, len(counts))


def check_grouped_gemm(ctx: Ctx) -> dict[str, Any]:
    from moebal.kernels import reference_experts, swiglu_experts

    if ctx.quick:
        counts, D, F_ = [0, 1, 7, 13, 0, 37, 5, 129], 64, 128
    else:
        counts, D, F_ = [0, 1, 7, 13, 0, 300, 5, 2049], 4096, 14336
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    ref_dtype = torch.float32 if dtype == torch.bfloat16 else torch.float64
    tol = TOL["bf16" if dtype == torch.bfloat16 else "fp32"]
    torch.manual_seed(0)
    plan = _plan_for(counts, ctx.device)
    x = torch.randn(sum(counts), D, device=ctx.device).to(dtype).requires_grad_(True)
    ws = _stacked(len(counts), D, F_, dtype, ctx.device)
    y = swiglu_experts(x, *ws, plan, "grouped_mm")
    g = torch.randn_like(y)
    got = [y, *torch.autograd.grad(y, [x, *ws], g)]
    leaves = [t.detach().to(ref_dtype).requires_grad_(True) for t in (x, *ws)]
    y_ref = reference_experts(*leaves, plan)
    want = [y_ref, *torch.autograd.grad(y_ref, leaves, g.to(ref_dtype))]
    errs: dict[str, Any] = {"y": _errs(got[0], want[0]), "dx": _errs(got[1], want[1])}
    ok = _within(errs["y"], tol) and _within(errs["dx"], tol)
    zero_ok = True
    for name, gw, rw in zip(("dw1", "dw3", "dw2"), got[2:], want[2:]):
        per = []
        for e, n in enumerate(counts):  # per expert: a small expert's error is not hidden by a large one's
            if n == 0:  # an expert without rows must get exact zeros (not stale memory)
                zero_ok &= bool(torch.count_nonzero(gw[e]) == 0)
                continue
            per.append(_errs(gw[e], rw[e]))
        errs[name] = {"worst_rel_norm": max(p["rel_norm"] for p in per),
                      "worst_rel_max": max(p["rel_max"] for p in per), "worst_max_abs": max(p["max_abs"] for p in per)}
        ok &= all(_within(p, tol) for p in per)
    worst = max(v.get("rel_norm", v.get("worst_rel_norm", 0.0)) for v in errs.values())
    return {"ok": ok and zero_ok, "counts": counts, "D": D, "F": F_, "dtype": str(dtype).replace("torch.", ""),
            "reference_dtype": str(ref_dtype).replace("torch.", ""), "tolerance": tol, "errors": _round(errs),
            "empty_experts_zero_grad": zero_ok,
            "summary": f"{len(counts)} experts, counts {counts}, worst rel-norm error {worst:.2e} "
                       f"(tol {tol['rel_norm']:g})"}


# ---- 4. moe_layer --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _count_syncs(dev: torch.device, rec: dict[str, Any]) -> Iterator[None]:
    """Host syncs of the block: CUDA's sync debug mode (every synchronising CUDA call, C++ ones included) and
    `moebal.sync.audit` (the intentional `to_host` syncs by reason, and other Python-level reads)."""
    try:
        from moebal.sync import audit
        auditor: Any = audit()
    except ImportError:
        auditor = contextlib.nullcontext(None)
    cuda = dev.type == "cuda"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with auditor as a:
                yield
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    rec["cuda_syncs"] = len(syncs) if cuda else None
    rec["cuda_sync_sites"] = sorted({_site(w.filename, w.lineno) for w in syncs})[:12]
    if a is not None:
        rec["audit_counted"] = dict(a.counted)
        rec["audit_unaccounted"] = list(a.unaccounted)[:12]
        rec["audit_syncs"] = int(a.syncs)


def _site(filename: str, lineno: int) -> str:
    """Where a sync warning came from, with the line's text (line numbers alone go stale as the tree moves)."""
    path = Path(filename).resolve()
    where = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else "/".join(path.parts[-3:])
    return f"{where}:{lineno}: {linecache.getline(filename, lineno).strip()[:100]}"


def _same_routing(r_dev: Any, r_ref: Any) -> torch.Tensor:
    """bool [T]: the token's choices (and which of them are active) are the same on both devices."""
    same_T = (r_dev.indices_TK.cpu() == r_ref.indices_TK).all(dim=1)
    a_dev, a_ref = r_dev.active_TK, r_ref.active_TK
    if (a_dev is None) != (a_ref is None):
        return torch.zeros_like(same_T)
    if a_dev is not None:
        same_T &= (a_dev.cpu() == a_ref).all(dim=1)
    return same_T


def _forward(layer: Any, x: torch.Tensor, bf16: bool, syncs: dict[str, Any] | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, x leaf) of one forward, its host syncs counted into `syncs` when given."""
    x = x.detach().clone().requires_grad_(True)
    counting = _count_syncs(x.device, syncs) if syncs is not None else contextlib.nullcontext()
    with counting, torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = layer(x)
    return out, x


def _backward(out: torch.Tensor, g: torch.Tensor, keep_T: torch.Tensor, syncs: dict[str, Any] | None) -> None:
    """Backward of sum(out * g) over the kept tokens. The aux loss is left out: it depends on every token's
    routing, including the tokens left out of the comparison."""
    loss = (out.float() * g * keep_T.to(out.device).unsqueeze(1)).sum()
    with _count_syncs(out.device, syncs) if syncs is not None else contextlib.nullcontext():
        loss.backward()


def _moe_variant(ctx: Ctx, kernel: str, bf16: bool, extra: dict[str, Any], shape: dict[str, int]) -> dict[str, Any]:
    """One layer configuration on the device against the same weights on CPU (the loop kernel there: it runs
    on any torch build). Tokens whose routing differs are left out of the loss on both sides."""
    from moebal import MoELayer

    T, D, F_, E, K = (shape[k] for k in ("T", "D", "F", "E", "K"))
    torch.manual_seed(1)
    ref = MoELayer(D, F_, E, K, kernel="loop", **extra)
    layer = MoELayer(D, F_, E, K, kernel=kernel, **extra).to(ctx.device)
    layer.load_state_dict(ref.state_dict())
    x, g = torch.randn(T, D), torch.randn(T, D)
    warm, _ = _forward(layer, torch.randn(T, D, device=ctx.device), bf16, None)  # one-time work left uncounted
    _backward(warm, g.to(ctx.device), torch.ones(T, dtype=torch.bool), None)
    layer.zero_grad(set_to_none=True)
    syncs: dict[str, Any] = {"forward": {}, "backward": {}}
    out_ref, x_ref = _forward(ref, x, bf16, None)
    out, x_dev = _forward(layer, x.to(ctx.device), bf16, syncs["forward"])
    keep_T = _same_routing(layer.last_routing, ref.last_routing)
    _backward(out_ref, g, keep_T, None)
    _backward(out, g.to(ctx.device), keep_T, syncs["backward"])
    tol = TOL["bf16" if bf16 else "fp32"]
    errs = {"out": _errs(out.detach().cpu()[keep_T], out_ref.detach()[keep_T]), "dx": _errs(x_dev.grad, x_ref.grad)}
    refs = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        gp, gr = p.grad, refs[name].grad
        errs[f"d.{name}"] = _errs(gp, gr) if gp is not None and gr is not None else {"missing_grad": True}
    bad = [k for k, e in errs.items() if "missing_grad" in e or not _within(e, tol)]
    mismatch = int((~keep_T).sum())
    active = layer.last_routing.active_TK
    return {"ok": not bad and mismatch <= MAX_ROUTING_MISMATCH * T, "kernel": kernel,
            "precision": "bf16 autocast" if bf16 else "fp32", "options": extra, "tolerance": tol,
            "routing_mismatch_tokens": mismatch,
            "inactive_assignments": int((~active).sum()) if active is not None else 0, "failed_tensors": bad,
            "worst_rel_norm": max(e.get("rel_norm", 0.0) for e in errs.values()), "errors": _round(errs),
            "syncs": syncs}


def _sync_totals(v: dict[str, Any], cuda: bool) -> tuple[int | None, int | None]:
    key = "cuda_syncs" if cuda else "audit_syncs"
    return v["syncs"]["forward"].get(key), v["syncs"]["backward"].get(key)


def check_moe_layer(ctx: Ctx) -> dict[str, Any]:
    shape = ({"T": 128, "D": 64, "F": 128, "E": 4, "K": 2} if ctx.quick else
             {"T": 1024, "D": 256, "F": 512, "E": 8, "K": 2})
    extras = {"dropless": {}, "capacity": {"capacity_factor": 1.0}, "adaptive": {"adaptive_threshold": 0.1}}
    variants: dict[str, Any] = {}
    for kernel, bf16 in (("loop", False), ("grouped_mm", True)):
        for ename, extra in extras.items():
            name = f"{'bf16' if bf16 else 'fp32'}_{kernel}_{ename}"
            try:
                variants[name] = _moe_variant(ctx, kernel, bf16, extra, shape)
            except Exception as e:  # noqa: BLE001 - one variant's failure is recorded, the others still run
                variants[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1000],
                                  "traceback": _tail(traceback.format_exc(), 8)}
    res: dict[str, Any] = {"ok": all(v["ok"] for v in variants.values()), "shape": shape,
                           "max_routing_mismatch_share": MAX_ROUTING_MISMATCH, "variants": variants, "skipped": []}
    table = {n: _sync_totals(v, ctx.cuda) for n, v in variants.items() if "syncs" in v}
    res["syncs_fwd_bwd"] = table
    budget = [t for n, t in table.items() if "grouped_mm" in n]
    res["sync_budget"] = "0 per forward and per backward (single-device MoELayer, grouped_mm)"
    res["sync_budget_basis"] = "torch.cuda.set_sync_debug_mode" if ctx.cuda else "moebal.sync.audit (Python reads)"
    res["sync_budget_ok"] = bool(budget) and all(f == 0 and b == 0 for f, b in budget)
    if not ctx.cuda:
        res["skipped"].append("cuda sync debug mode: skipped: needs CUDA (CPU counts come from moebal.sync.audit)")
        res["skipped"].append("device vs CPU: skipped: no CUDA device, the CPU layer runs on both sides")
    gmm = table.get("bf16_grouped_mm_dropless", (None, None))
    res["summary"] = (f"{sum(v['ok'] for v in variants.values())}/{len(variants)} variants within tolerance; "
                      f"grouped_mm dropless syncs fwd/bwd {gmm[0]}/{gmm[1]}; sync budget "
                      f"{'met' if res['sync_budget_ok'] else 'MISSED'}")
    return res


# ---- 5. train_resume ----------------------------------------------------------------------------------------

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
        "model.max_seq_len=64", "moe.num_experts=4", "moe.top_k=2", "moe.expert_ffn_dim=64", "data.seq_len=32",
        "data.batch_size=4", "data.max_bytes=300000", "train.warmup_steps=2", "train.eval_every=3",
        "train.eval_batches=2", "train.precision=fp32", "train.threads=2"]
# The default model on the GPU; a constant learning rate after warm-up (min_lr_ratio 1), so the 100-step run
# resumed to 120 follows the same schedule as the straight 120-step run (the cosine decay ends at train.steps).
GPU_TRAIN = ["data.max_bytes=4000000", "train.eval_batches=4"]
COMMON_TRAIN = ["train.min_lr_ratio=1.0", "train.ckpt_every=0", "train.progress=plain"]


# `moebal train` with torch's deterministic algorithms on (CUDA): a resumed run can equal a straight one bitwise
# only if the straight run equals itself, and on a GPU some kernels (attention backward, index_add_) add in
# an order that changes from run to run unless asked not to; the CPU kernels are deterministic already.
DETERMINISTIC_CLI = ("import sys, torch; torch.use_deterministic_algorithms(True, warn_only=True); "
                     "from moebal.cli import main; sys.exit(main(sys.argv[1:]))")


def _train(ctx: Ctx, out: Path, steps: int, overrides: list[str], resume: bool,
           deterministic: bool = True) -> dict[str, Any]:
    args = ["train", "--nproc", "1", "--steps", str(steps), "--out", str(out), "--json"]
    args += ["--resume"] if resume else overrides
    env = _env()
    if ctx.cuda and deterministic:
        cmd = [sys.executable, "-c", DETERMINISTIC_CLI, *args]
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # what deterministic cuBLAS needs
    else:
        cmd = [sys.executable, "-m", "moebal.cli", *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=max(30.0, min(240.0, ctx.left())))
    if r.returncode != 0:
        raise RuntimeError(f"moebal train ({' '.join(args)}) exited {r.returncode}: {_tail(r.stderr, 12)}")
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    return summary


def _records(run: Path) -> list[dict[str, Any]]:
    """A run's metrics lines."""
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run) if "loss" in r}


def check_train_resume(ctx: Ctx) -> dict[str, Any]:
    first, total = (6, 8) if ctx.quick else (100, 120)
    overrides = (TINY if ctx.quick else GPU_TRAIN) + COMMON_TRAIN
    base = ctx.workdir / "train"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    a, a2, b = base / f"first-{first}", base / f"resumed-{total}", base / f"straight-{total}"
    s_a = _train(ctx, a, first, overrides, resume=False)
    shutil.copytree(a, a2)
    s_a2 = _train(ctx, a2, total, overrides, resume=True)
    s_b = _train(ctx, b, total, overrides, resume=False)
    la, la2, lb = _losses(a), _losses(a2), _losses(b)
    tail = list(range(first + 1, total + 1))
    resumed_ok = all(s in la2 and s in lb for s in tail) and all(la2[s] == lb[s] for s in tail)
    repeatable = all(s in lb and la.get(s) == lb[s] for s in range(1, first + 1))
    diverged = next((s for s in range(1, total + 1) if la2.get(s) != lb.get(s)), None)
    q = max(1, total // 4)
    early = statistics.mean(lb[s] for s in range(1, q + 1))
    late = statistics.mean(lb[s] for s in range(total - q + 1, total + 1))
    res = {"ok": resumed_ok and late < early, "config": "tiny" if ctx.quick else "default",
           "deterministic_algorithms": ctx.cuda,
           "overrides": overrides, "steps": [first, total], "resume_bitwise": resumed_ok,
           "first_steps_repeatable": repeatable, "first_differing_step": diverged,
           "loss_first_quarter": early, "loss_last_quarter": late, "val_loss": s_b.get("val_loss"),
           "tokens_per_s": s_b.get("tokens_per_s"), "run_wall_s": [s_a["wall_s"], s_a2["wall_s"], s_b["wall_s"]],
           "losses_resumed_tail": [la2.get(s) for s in tail][-5:],
           "losses_straight_tail": [lb.get(s) for s in tail][-5:]}
    if not resumed_ok:
        why = "the straight runs differ too (nondeterministic kernels)" if not repeatable else "resume differs"
        res["error"] = f"steps {first + 1}-{total}: resumed != straight from step {diverged}: {why}"
    res["summary"] = (f"loss {early:.3f} -> {late:.3f}, resume {'bitwise' if resumed_ok else 'DIFFERS'}, "
                      f"{s_b.get('tokens_per_s', float('nan')):.0f} tokens/s"
                      + (" (deterministic algorithms)" if ctx.cuda else ""))
    return res


# ---- 6. expert_kernel_vs_dense --------------------------------------------------------------------------------

def _time_events(fns: dict[str, Callable[[], Any]], warmup: int, repeats: int) -> dict[str, Any]:
    """CUDA-event times of several methods, round-robin (each round calls every method once, rotated), so a
    drift of the clock or the card hits all alike; summarised by the shared timing helper."""
    from moebal.kernels.bench import summarise

    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    ms: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[: r % len(names)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[n]()
            end.record()
            end.synchronize()
            ms[n].append(start.elapsed_time(end) / 1e3)
    return {n: summarise(s) for n, s in ms.items()}


def _skewed(N: int, E: int, factor: float) -> list[int]:
    """Counts summing to N whose busiest expert holds `factor` x the mean, the rest spread evenly."""
    big = int(round(factor * N / E))
    rest = N - big
    return [big] + [rest // (E - 1) + (1 if i < rest % (E - 1) else 0) for i in range(E - 1)]


def check_expert_vs_dense(ctx: Ctx) -> dict[str, Any]:
    from moebal.kernels import swiglu_experts
    from moebal.kernels.bench import time_interleaved
    from moebal.kernels.expert_ffn import auto_kernel

    full = ctx.cuda and not ctx.quick
    N, D, F_, E = (16384, 4096, 14336, 8) if full else (1024, 64, 128, 8)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    kernel = auto_kernel(ctx.device, D, F_, dtype)
    torch.manual_seed(0)
    x = torch.randn(N, D, device=ctx.device).to(dtype).requires_grad_(True)
    g = torch.randn(N, D, device=ctx.device).to(dtype)
    dense = [w[0].detach().clone().requires_grad_(True) for w in _stacked(1, D, F_, dtype, ctx.device)]
    ws = _stacked(E, D, F_, dtype, ctx.device)
    counts = {"balanced": [N // E] * E, "skewed_4x": _skewed(N, E, 4.0)}
    plans = {k: _plan_for(c, ctx.device) for k, c in counts.items()}

    def run_dense() -> None:
        w1, w3, w2 = dense
        y = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
        torch.autograd.grad(y, [x, *dense], g)

    def run_experts(plan: Any) -> Callable[[], None]:
        return lambda: torch.autograd.grad(swiglu_experts(x, *ws, plan, kernel), [x, *ws], g)

    fns = {"dense": run_dense, **{k: run_experts(p) for k, p in plans.items()}}
    if ctx.cuda:
        times = _time_events(fns, warmup=3, repeats=10 if full else 5)
    else:
        times = time_interleaved(fns, warmup=1, repeats=3, device=ctx.device)
    flop = 18.0 * N * D * F_  # 3 GEMMs of 2NDF forward, twice that backward (input and weight gradients)
    t = {k: v.median for k, v in times.items()}
    res: dict[str, Any] = {"ok": True, "shape": {"N": N, "D": D, "F": F_, "E": E},
                           "dtype": str(dtype).replace("torch.", ""), "kernel": kernel, "counts": counts,
                           "timing": "cuda events" if ctx.cuda else "wall clock",
                           "times_s": {k: v.to_dict() for k, v in times.items()},
                           "tflops": {k: flop / s / 1e12 for k, s in t.items()},
                           "x_dense": {k: t[k] / t["dense"] for k in counts}, "targets_x_dense":
                           {"balanced": 1.15, "skewed_4x": 1.3}, "skipped": []}
    if full:
        res["targets_met"] = {k: res["x_dense"][k] <= v for k, v in res["targets_x_dense"].items()}
    else:
        res["targets_met"] = None
        res["skipped"].append("targets: skipped: they are set for an H100 at the full shape (not --quick, CUDA)")
    xd = res["x_dense"]
    res["summary"] = (f"{kernel}: balanced {xd['balanced']:.2f}x dense, skewed {xd['skewed_4x']:.2f}x; "
                      f"dense {res['tflops']['dense']:.1f} TFLOP/s" + ("" if full else " (targets not applied)"))
    return _round(res)


# ---- 7. recompute -----------------------------------------------------------------------------------------------

RECOMPUTE_MODES = ("none", "moe", "attention", "full")


def _recompute_config(shape: dict[str, int], mode: str) -> Any:
    """The model `scripts/measure_recompute.py` measures on a CPU, at the given shape (MoE every layer, top-2)."""
    from moebal.config import from_dict

    D = shape["D"]
    return from_dict({
        "model": {"vocab_size": 256, "dim": D, "n_layers": shape["L"], "n_heads": shape["H"], "n_kv_heads": shape["H"],
                  "ffn_dim": 4 * D, "max_seq_len": shape["T"]},
        "moe": {"num_experts": shape["E"], "top_k": 2, "expert_ffn_dim": 2 * D},
        "data": {"seq_len": shape["T"]}, "train": {"recompute": mode}})


def _recompute_models(ctx: Ctx, shape: dict[str, int]) -> dict[str, Any]:
    """One model per mode, each built from seed 0 on the device (so all hold the same weights)."""
    from moebal.models import build_model

    models = {}
    for mode in RECOMPUTE_MODES:
        torch.manual_seed(0)
        with ctx.device:  # built where it runs (a CPU build of the full-shape model would take most of the check)
            models[mode] = build_model(_recompute_config(shape, mode)).to(ctx.device).train()
    return models


def _recompute_exact(ctx: Ctx, models: dict[str, Any], ids: torch.Tensor) -> dict[str, Any]:
    """fp32 loss and every gradient of each mode against `none`, bitwise (deterministic algorithms and SDPA's math
    backend on CUDA: the memory-efficient kernel's backward adds with atomics, so there none differs from itself
    by about 1e-6 relative on an H200, which would hide what recomputation itself changes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(ctx.cuda, warn_only=True)
    backends = [SDPBackend.MATH] if ctx.cuda else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    try:
        got: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for mode, model in [("none_again", models["none"]), *models.items()]:
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)  # the same RNG stream for every mode (router jitter, if any)
            with sdpa_kernel(backends):
                out = model(ids, ids)
                loss = out.loss + out.aux_loss
                loss.backward()
            got[mode] = (loss.detach().clone(), [p.grad.detach().clone() for p in model.parameters()
                                                 if p.grad is not None])
            model.zero_grad(set_to_none=True)
    finally:
        torch.use_deterministic_algorithms(det, warn_only=True)
    ref_loss, ref_grads = got["none"]
    rows = {}
    for mode, (loss, grads) in got.items():
        same = len(grads) == len(ref_grads)
        rows[mode] = {"bitwise": bool(same and torch.equal(loss, ref_loss)
                                      and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))),
                      "loss_diff": abs(float(loss - ref_loss)),
                      "grad_rel_norm_max": max((float((a - b).norm() / b.norm().clamp_min(1e-30))
                                                for a, b in zip(grads, ref_grads)), default=0.0) if same else None}
    return rows


def _rotated_costs(ctx: Ctx, runs: dict[Any, Callable[[], None]], rounds: int, steps: int, key: str
                   ) -> list[dict[str, Any]]:
    """Activation peak (the allocator's peak over the steps minus what was allocated before them: weights and kept
    gradients) and step time (CUDA events; wall clock on a CPU, where the peak is not measured) of each run, after
    one warm-up step of every run (gradients allocated and kept, kernels warmed), runs rotated per round, every
    round kept: one row per round and run, the run's name under `key`."""
    for run in runs.values():
        run()
    names = list(runs)
    rows: list[dict[str, Any]] = []
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times, peak = [], None
            if ctx.cuda:
                torch.cuda.synchronize(ctx.device)
                base = torch.cuda.memory_allocated(ctx.device)
                torch.cuda.reset_peak_memory_stats(ctx.device)
            for _ in range(steps):
                if ctx.cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    runs[name]()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                else:
                    t0 = time.perf_counter()
                    runs[name]()
                    times.append(time.perf_counter() - t0)
            if ctx.cuda:
                peak = (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**20
            rows.append({"round": r, key: name, "step_s": statistics.median(times), "steps_s": times,
                         "act_peak_mb": peak})
    return rows


def _recompute_cost(ctx: Ctx, models: dict[str, Any], ids: torch.Tensor, rounds: int, steps: int,
                    bf16: bool) -> dict[str, Any]:
    """Activation peak and step time of each mode (`_rotated_costs`)."""
    def step(model: Any) -> None:
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(ids, ids)
            loss = out.loss + out.aux_loss
        loss.backward()
        model.zero_grad(set_to_none=False)

    runs: dict[Any, Callable[[], None]] = {mode: (lambda m=m: step(m)) for mode, m in models.items()}
    return {"rounds": _rotated_costs(ctx, runs, rounds, steps, "mode")}


def check_recompute(ctx: Ctx) -> dict[str, Any]:
    full = ctx.cuda and not ctx.quick
    shape = ({"D": 1024, "L": 8, "H": 16, "E": 8, "T": 2048, "B": 8} if full
             else {"D": 64, "L": 2, "H": 4, "E": 4, "T": 64, "B": 2})
    rounds, steps = (3, 5) if full else (1, 1)
    models = _recompute_models(ctx, shape)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (shape["B"], shape["T"]), generator=g).to(ctx.device)
    exact = _recompute_exact(ctx, models, ids[:2, : min(shape["T"], 512)])
    bf16 = ctx.cuda and torch.cuda.is_bf16_supported()
    cost = _recompute_cost(ctx, models, ids, rounds, steps, bf16)
    summary: dict[str, dict[str, Any]] = {}
    for mode in RECOMPUTE_MODES:
        mine = [row for row in cost["rounds"] if row["mode"] == mode]
        summary[mode] = {"step_s": statistics.median(row["step_s"] for row in mine),
                         "act_peak_mb": (statistics.median(row["act_peak_mb"] for row in mine) if ctx.cuda else None)}
    for mode in RECOMPUTE_MODES:
        summary[mode]["time_ratio"] = summary[mode]["step_s"] / summary["none"]["step_s"]
        if ctx.cuda:
            summary[mode]["act_ratio"] = summary[mode]["act_peak_mb"] / summary["none"]["act_peak_mb"]
    del models
    targets = {"full_act_ratio_max": 0.35, "full_time_ratio_max": 1.4}
    res: dict[str, Any] = {"ok": all(r["bitwise"] for r in exact.values()), "shape": shape,
                           "rounds_x_steps": [rounds, steps], "dtype": "bf16 autocast" if bf16 else "fp32",
                           "exact_fp32": exact, "summary_by_mode": summary, "targets": targets, "skipped": [], **cost}
    if not res["ok"]:
        why = ("" if exact["none_again"]["bitwise"] else
               " (none differs from itself: kernels without a deterministic implementation)")
        res["error"] = f"recompute differs from none in fp32: {[m for m, r in exact.items() if not r['bitwise']]}{why}"
    if full:
        res["targets_met"] = {"act": summary["full"]["act_ratio"] <= targets["full_act_ratio_max"],
                              "time": summary["full"]["time_ratio"] <= targets["full_time_ratio_max"]}
    else:
        res["targets_met"] = None
        res["skipped"].append("targets: skipped: they are set for a GPU at the full shape (not --quick, CUDA)")
    if not ctx.cuda:
        res["skipped"].append("activation peak: skipped: the allocator's peak is CUDA's "
                              "(scripts/measure_recompute.py measures resident memory on a CPU)")
    f = summary["full"]
    act = f" act {f['act_ratio']:.2f}x," if ctx.cuda else ""
    res["summary"] = (f"fp32 {'bitwise' if res['ok'] else 'DIFFERS'}; full recompute:{act} time "
                      f"{f['time_ratio']:.2f}x of none ({res['dtype']})")
    return _round(res)


# ---- 9. grad_accum --------------------------------------------------------------------------------------------

ACCUM_COUNTS = (1, 2, 4)


def _accum_trainers(ctx: Ctx, shape: dict[str, int], aux: float) -> dict[int, Any]:
    """One `Trainer` per `train.grad_accum` count, each on the device from seed 0 (the same weights). A trainer sets
    torch's threads (`train.threads`); the caller restores them."""
    from moebal.config import with_overrides
    from moebal.train import Trainer

    out = {}
    for A in ACCUM_COUNTS:
        cfg = with_overrides(_recompute_config(shape, "none"), [
            f"train.grad_accum={A}", f"data.batch_size={shape['B']}", "data.max_bytes=200000", "train.threads=2",
            f"moe.aux_loss_coef={aux}", "train.progress=plain", "train.precision=fp32"])
        torch.manual_seed(0)  # built on the host and moved (the trainer's own path), so every count's weights agree
        out[A] = Trainer(cfg, ctx.workdir / "accum" / f"a{A}", device=ctx.device)
    return out


def _accum_pass(trainer: Any, batch: Any, bf16: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The local strategy's forward and backward of one batch (its micro-batches); the loss and the gradients."""
    trainer.model.zero_grad(set_to_none=True)
    with torch.autocast(trainer.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss, _, _ = trainer.strategy.forward_backward(trainer, 1, batch, 1.0)
    return loss.detach().clone(), [p.grad.detach().clone() for p in trainer.model.parameters() if p.grad is not None]


def check_grad_accum(ctx: Ctx) -> dict[str, Any]:
    """`train.grad_accum` 1, 2 and 4 through the trainer's own step code (`LocalStep.forward_backward`) on the
    device: in fp32 without the balancing loss (whose per-micro-batch form is another loss) the loss and every
    gradient against A = 1 within 1e-5 relative (summation order only), then in bf16 autocast the activation
    peak (the allocator's peak over the pass minus what was allocated before it) and the pass time (CUDA
    events), counts rotated per round, every round kept."""
    full = ctx.cuda and not ctx.quick
    shape = ({"D": 1024, "L": 2, "H": 16, "E": 8, "T": 2048, "B": 8} if full
             else {"D": 64, "L": 2, "H": 4, "E": 4, "T": 64, "B": 4})
    rounds, passes = (3, 3) if full else (1, 1)
    threads = torch.get_num_threads()
    try:
        return _grad_accum(ctx, shape, rounds, passes)
    finally:
        torch.set_num_threads(threads)


def _grad_accum(ctx: Ctx, shape: dict[str, int], rounds: int, passes: int) -> dict[str, Any]:
    from moebal.data import Batch

    trainers = _accum_trainers(ctx, shape, aux=0.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (shape["B"], shape["T"]), generator=g)
    batch = Batch(ids, ids.roll(-1, dims=1), ids.numel())  # host tensors: the strategy moves each micro-batch
    det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(ctx.cuda, warn_only=True)
    try:
        got = {A: _accum_pass(t, batch, bf16=False) for A, t in trainers.items()}
    finally:
        torch.use_deterministic_algorithms(det, warn_only=True)
    ref_loss, ref_grads = got[1]
    exact = {}
    for A, (loss, grads) in got.items():
        same = len(grads) == len(ref_grads)
        worst = max((float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(grads, ref_grads)),
                    default=0.0) if same else None
        exact[A] = {"loss_rel": abs(float(loss - ref_loss)) / max(abs(float(ref_loss)), 1e-30),
                    "grad_rel_norm_max": worst}
    bf16 = ctx.cuda and torch.cuda.is_bf16_supported()

    def one_pass(trainer: Any) -> None:
        _accum_pass(trainer, batch, bf16)

    runs: dict[Any, Callable[[], None]] = {A: (lambda t=t: one_pass(t)) for A, t in trainers.items()}
    rows = _rotated_costs(ctx, runs, rounds, passes, "grad_accum")
    for t in trainers.values():
        t.close()
    del trainers
    summary: dict[int, dict[str, Any]] = {}
    for A in ACCUM_COUNTS:
        mine = [row for row in rows if row["grad_accum"] == A]
        summary[A] = {"pass_s": statistics.median(row["step_s"] for row in mine),
                      "act_peak_mb": statistics.median(row["act_peak_mb"] for row in mine) if ctx.cuda else None}
    for A in ACCUM_COUNTS:
        summary[A]["time_ratio"] = summary[A]["pass_s"] / summary[1]["pass_s"]
        if ctx.cuda:
            summary[A]["act_ratio"] = summary[A]["act_peak_mb"] / summary[1]["act_peak_mb"]
    ok = all(e["grad_rel_norm_max"] is not None and e["grad_rel_norm_max"] < 1e-5 and e["loss_rel"] < 1e-5
             for e in exact.values())
    res: dict[str, Any] = {"ok": ok, "shape": shape, "rounds_x_passes": [rounds, passes],
                           "dtype": "bf16 autocast" if bf16 else "fp32", "exact_fp32": exact,
                           "summary_by_count": summary, "rounds": rows, "skipped": []}
    if not ok:
        res["error"] = f"accumulated gradients differ from one pass by more than 1e-5: {exact}"
    if not ctx.cuda:
        res["skipped"].append("activation peak: skipped: the allocator's peak is CUDA's (scripts/bench_memory.py "
                              "measures resident memory on a CPU)")
    four = summary[4]
    act = f" act {four['act_ratio']:.2f}x," if ctx.cuda else ""
    res["summary"] = (f"fp32 within {max(e['grad_rel_norm_max'] or 0.0 for e in exact.values()):.1e} of one pass; "
                      f"grad_accum=4:{act} time {four['time_ratio']:.2f}x of 1 ({res['dtype']})")
    return _round(res)


# ---- 8. memory_plan ---------------------------------------------------------------------------------------------

# `moebal train` on one device, then the CUDA allocator's figures, written where MOEBAL_GPU_STATS says.
STATS_CLI = ("import json, os, sys, torch; from moebal.cli import main; rc = main(sys.argv[1:]); "
             "d = torch.device('cuda', torch.cuda.current_device()) if torch.cuda.is_available() else None; "
             "free, total = torch.cuda.mem_get_info(d) if d is not None else (0, 0); "
             "st = {'max_allocated': torch.cuda.max_memory_allocated(d), 'max_reserved': "
             "torch.cuda.max_memory_reserved(d), 'reserved': torch.cuda.memory_reserved(d), 'used': total - free, "
             "'total': total} if d is not None else {}; "
             "open(os.environ['MOEBAL_GPU_STATS'], 'w').write(json.dumps(st)); sys.exit(rc)")
MEM_MODEL = ["model.dim=1024", "model.n_layers=8", "model.n_heads=16", "model.n_kv_heads=8", "model.ffn_dim=2816",
             "model.max_seq_len=2048", "moe.num_experts=8", "moe.top_k=2", "moe.expert_ffn_dim=1408",
             "data.seq_len=2048", "data.batch_size=8"]
MEM_COMMON = ["data.max_bytes=4000000", "train.eval_every=0", "train.eval_batches=1", "train.warmup_steps=1",
              "train.ckpt_every=0", "train.progress=plain", "data.val_fraction=0", "train.steps=6"]
MEM_LAYOUTS = {"bf16_none": ["train.precision=bf16", "train.recompute=none"],
               "bf16_full": ["train.precision=bf16", "train.recompute=full"],
               "fp32_none": ["train.precision=fp32", "train.recompute=none"],
               "fp32_moe": ["train.precision=fp32", "train.recompute=moe"],
               "bf16_none_seq4096": ["train.precision=bf16", "train.recompute=none", "data.seq_len=4096",
                                     "model.max_seq_len=4096", "data.batch_size=4"]}


def _mem_predict(ctx: Ctx, overrides: list[str], capacity: float) -> dict[str, Any]:
    """The plan of a one-rank run on the h100 profile's runtime and slack assumptions, at the card's capacity."""
    from moebal.config import load
    from moebal.planner.hardware import load_profile
    from moebal.planner.memory import DeviceMemory, layout_from_config, plan_memory

    cfg = load(None, overrides)
    prof = load_profile("h100")
    dev = DeviceMemory(name="this card", capacity_bytes=capacity, runtime_bytes=prof.memory_reserved_bytes,
                       slack=prof.allocator_slack, cuda=True)
    precision = "bf16" if cfg.train.precision == "bf16" else "fp32"
    plan = plan_memory(cfg, layout_from_config(cfg, 1, precision=precision), dev)
    body = (plan.peak_bytes - dev.runtime_bytes) / (1 + dev.slack)
    return {"peak_bytes": plan.peak_bytes, "body_bytes": body, "runtime_bytes": dev.runtime_bytes,
            "slack": dev.slack, "largest_term": plan.largest_term[0], "terms": plan.to_dict()["terms"]}


def _mem_run(ctx: Ctx, name: str, overrides: list[str]) -> dict[str, Any]:
    out = ctx.workdir / "memory" / name
    shutil.rmtree(out, ignore_errors=True)
    stats = ctx.workdir / "memory" / f"{name}.json"
    stats.parent.mkdir(parents=True, exist_ok=True)
    env = {**_env(), "MOEBAL_GPU_STATS": str(stats)}
    args = ["train", "--nproc", "1", "--out", str(out), "--json", *overrides]
    r = subprocess.run([sys.executable, "-c", STATS_CLI, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=max(30.0, min(180.0, ctx.left())))
    if r.returncode != 0:
        raise RuntimeError(f"moebal train ({name}) exited {r.returncode}: {_tail(r.stderr, 12)}")
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    times = [r["step_time_s"] for r in recs if "step_time_s" in r and r.get("step", 0) > 1]  # step 1: warm-up
    return {"stats": json.loads(stats.read_text(encoding="utf-8")), "tokens_per_s": summary.get("tokens_per_s"),
            "step_s": statistics.median(times) if times else None}


def _step_predict(overrides: list[str], profile: str) -> float:
    """The simulator's one-rank step time on `profile` (balanced routing: the run's counts are not replayed)."""
    from moebal.config import load
    from moebal.planner.cost import CostModel, ModelShape
    from moebal.sim.program import Layout, SimSpec
    from moebal.sim.simulate import simulate

    cfg = load(None, overrides)
    precision = "bf16" if cfg.train.precision == "bf16" else "fp32"
    spec = SimSpec(layout=Layout(1), micro_batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                   count_exchange=False, recompute=cfg.train.recompute)
    E, rows = cfg.moe.num_experts, cfg.data.batch_size * cfg.data.seq_len * cfg.moe.top_k
    counts = (np.full((cfg.model.n_layers, 1, 1, E), rows / E) if E else None)  # [L, micro-batch, rank, E]
    return float(simulate(ModelShape.from_config(cfg), CostModel(profile, precision), spec, counts).iteration_time_s)


def check_memory_plan(ctx: Ctx) -> dict[str, Any]:
    tiny = [o for o in TINY if not o.startswith("train.eval")] + ["train.eval_every=0", "train.steps=2",
                                                                  "train.ckpt_every=0", "train.progress=plain"]
    layouts = ({"tiny_fp32_none": tiny} if not ctx.cuda or ctx.quick
               else {k: MEM_MODEL + MEM_COMMON + v for k, v in MEM_LAYOUTS.items()})
    capacity = float(torch.cuda.get_device_properties(ctx.device).total_memory) if ctx.cuda else 80e9
    rows: dict[str, Any] = {}
    for name, overrides in layouts.items():
        pred = _mem_predict(ctx, overrides, capacity)
        run = _mem_run(ctx, name, overrides)
        row: dict[str, Any] = {"overrides": overrides, "predicted": pred, "tokens_per_s": run["tokens_per_s"],
                               "step_s": run["step_s"], "step_s_predicted_h100": _step_predict(overrides, "h100")}
        if run["step_s"]:
            row["error"] = {"step_time_h100_profile": row["step_s_predicted_h100"] / run["step_s"] - 1}
        st = run["stats"]
        if st:
            runtime = st["used"] - st["reserved"]
            peak = runtime + st["max_reserved"]
            row["measured"] = {**st, "runtime_bytes": runtime, "peak_bytes": peak,
                               "slack": st["max_reserved"] / st["max_allocated"] - 1}
            row["error"] = {**row.get("error", {}), "peak": pred["peak_bytes"] / peak - 1,
                            "body_vs_max_allocated": pred["body_bytes"] / st["max_allocated"] - 1}
        rows[name] = row
    res: dict[str, Any] = {"ok": True, "profile_assumptions": "h100", "layouts": rows, "skipped": []}
    if not ctx.cuda:
        res["skipped"].append("measured peak: skipped: CUDA allocator figures only (scripts/bench_memory.py "
                              "validates the plan against resident memory on a CPU)")
        res["summary"] = f"plan and run of {len(rows)} layout(s); measurement CUDA-only"
        return _round(res)
    from moebal.planner.hardware import load_profile

    prof = load_profile("h100")  # the assumptions `_mem_predict` planned with
    errs = [r["error"]["peak"] for r in rows.values()]
    res["median_abs_peak_error"] = statistics.median(abs(e) for e in errs)
    res["measured_runtime_bytes"] = statistics.median(r["measured"]["runtime_bytes"] for r in rows.values())
    res["measured_slack"] = statistics.median(r["measured"]["slack"] for r in rows.values())
    res["step_time_errors_h100_profile"] = [r["error"].get("step_time_h100_profile") for r in rows.values()]
    res["summary"] = (f"{len(rows)} layouts: peak error median {res['median_abs_peak_error']:.1%} "
                      f"(per layout {', '.join(f'{e:+.0%}' for e in errs)}); runtime "
                      f"{res['measured_runtime_bytes'] / 1e9:.2f} GB (profile {prof.memory_reserved_bytes / 1e9:.1f}), "
                      f"slack {res['measured_slack']:.1%} (profile {prof.allocator_slack:.0%}, fitted on these "
                      "layouts: in sample)")
    return _round(res)


# ---- 10. sparse_attention --------------------------------------------------------------------------------------

SPARSE_DENSITIES = (0.75, 0.5, 0.25, 0.1)


FORM_DENSITIES = (0.5, 0.25)


def _act_peak_mb(ctx: Ctx, fn: Callable[[], None]) -> float:
    """The allocator's peak over one call of `fn` minus what was allocated before it, in MiB (CUDA only)."""
    torch.cuda.synchronize(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    fn()
    torch.cuda.synchronize(ctx.device)
    return (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**20


def _sdpa_backends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> dict[str, dict[str, str]]:
    """Which SDPA backends take each call form of the sparse kernel and of dense attention, forward and backward,
    each forced alone (`sdpa_kernel`): "ok" or the error's first line. A masked call is one run of 4 query
    blocks over 8 kept key blocks (an additive [b, 8 b] mask), grouped (`enable_gqa`) or with keys and values
    expanded to every query head; the dense calls are the whole sequence, causal or under a [T, T] mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, T, K = q.shape
    G, b = k.shape[1], block
    c = min(8, T // b)
    qr = q.detach()[:, :, :b].repeat(4, 1, 1, 1).requires_grad_(True)
    kr, vr = (t.detach()[:, :, :c * b].repeat(4, 1, 1, 1).requires_grad_(True) for t in (k, v))
    kx, vx = (t.detach().repeat_interleave(H // G, dim=1).requires_grad_(True) for t in (kr, vr))
    m = torch.zeros(b, c * b, dtype=q.dtype, device=q.device)
    m[:, (c - 1) * b:].masked_fill_(torch.ones(b, b, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    qd, kd, vd = (t.detach().requires_grad_(True) for t in (q, k, v))
    full_m = torch.zeros(T, T, dtype=q.dtype, device=q.device).masked_fill_(
        torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "masked run, grouped": lambda: F.scaled_dot_product_attention(qr, kr, vr, attn_mask=m, enable_gqa=G != H),
        "masked run, expanded": lambda: F.scaled_dot_product_attention(qr, kx, vx, attn_mask=m),
        "dense causal, grouped": lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                                                        enable_gqa=G != H),
        "dense [T, T] mask, grouped": lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=full_m,
                                                                             enable_gqa=G != H),
    }
    out: dict[str, dict[str, str]] = {}
    for name, call in calls.items():
        out[name] = {}
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.MATH):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with sdpa_kernel([backend]):
                        call().float().sum().backward()
                    out[name][backend.name] = "ok"
                except RuntimeError as e:
                    # torch gives each refused kernel's reasons as warnings before the error
                    why = [str(w.message).strip().splitlines()[0][:160] for w in caught]
                    out[name][backend.name] = " | ".join(why[:4] or [str(e).strip().splitlines()[0][:200]])
    return out


SPARSE_LENGTHS = (8192, 16384, 32768)


def _sparse_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, block: int,
                  density: float) -> dict[str, Any]:
    """Where the flex path's time goes (CUDA events, round-robin): the block selection alone, the selection and
    the block mask, the compiled kernel's forward and backward under a prebuilt mask, and all three, beside dense
    causal SDPA."""
    from moebal.kernels.sparse_attention import flex_block_attention, flex_block_mask, select_blocks

    H, T = q.shape[1], q.shape[2]
    sel = select_blocks(q, k, block, density)
    mask = flex_block_mask(sel, H, T)

    def kernel() -> None:
        from moebal.kernels.sparse_attention import _flex_attention

        y = _flex_attention("cuda")(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != H)
        torch.autograd.grad(y, [q, k, v], g)

    def whole() -> None:
        y = flex_block_attention(q, k, v, select_blocks(q, k, block, density))
        torch.autograd.grad(y, [q, k, v], g)

    fns: dict[str, Callable[[], Any]] = {
        "dense": lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                            enable_gqa=True), [q, k, v], g),
        "select": lambda: select_blocks(q, k, block, density),
        "select+mask": lambda: flex_block_mask(select_blocks(q, k, block, density), H, T),
        "kernel": kernel, "whole": whole}
    times = _time_events(fns, warmup=3, repeats=10)
    return {"density": density, "median_s": {n: t.median for n, t in times.items()},
            "x_dense": {n: times[n].median / times["dense"].median for n in fns if n != "dense"}}


def _sparse_lengths(ctx: Ctx, H: int, G: int, K: int, block: int) -> dict[str, Any]:
    """Longer rows (B = 1), bf16: dense causal SDPA against the flex path at densities 0.5, 0.25, 0.1 and the
    masked path at 0.25, selection included (CUDA events, round-robin, the first warm-up call compiles)."""
    out: dict[str, Any] = {}
    for T in SPARSE_LENGTHS:
        out[str(T)] = _sparse_length(ctx, T, H, G, K, block) if ctx.left() >= 60 else {"skipped": "budget"}
        _free(ctx)
    return out


def _sparse_length(ctx: Ctx, T: int, H: int, G: int, K: int, block: int) -> dict[str, Any]:
    from moebal.kernels.sparse_attention import block_sparse_attention, select_blocks

    torch.manual_seed(1)
    q = torch.randn(1, H, T, K, device=ctx.device, dtype=torch.bfloat16).requires_grad_(True)
    k, v = (torch.randn(1, G, T, K, device=ctx.device, dtype=torch.bfloat16).requires_grad_(True) for _ in range(2))
    g = torch.randn(1, H, T, K, device=ctx.device, dtype=torch.bfloat16)

    def at(d: float, path: str) -> Callable[[], None]:
        def run() -> None:
            y = block_sparse_attention(q, k, v, select_blocks(q, k, block, d), path=path)
            torch.autograd.grad(y, [q, k, v], g)
        return run

    fns: dict[str, Callable[[], Any]] = {
        "dense": lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                            enable_gqa=True), [q, k, v], g),
        **{f"flex:{d}": at(d, "flex") for d in (0.5, 0.25, 0.1)}, "masked:0.25": at(0.25, "masked")}
    times = _time_events(fns, warmup=2, repeats=5)
    return {"median_s": {n: t.median for n, t in times.items()},
            "x_dense": {n: times[n].median / times["dense"].median for n in fns if n != "dense"}}


def check_sparse_attention(ctx: Ctx) -> dict[str, Any]:
    """The block-sparse attention kernel on the device: parity of every path that trains there with dense
    attention under the same block mask (output and dq, dk, dv) at densities 0.5 and 0.25; fwd+bwd time
    (selection included) of each path over the dense causal SDPA call at each density, and of the masked path's
    grouped and expanded forms; activation peaks and the SDPA backends of each call form (CUDA); the flex path's
    parts and longer rows (CUDA); and the sparse_attention scheme's start-up fit (`costs: measure`)."""
    from moebal.config import from_dict
    from moebal.dynamism.sparse_attention import fit_attention_factors, measure_attention_factors
    from moebal.kernels.bench import time_interleaved
    from moebal.kernels.sparse_attention import (
        block_sparse_attention,
        default_path,
        dense_block_attention,
        masked_block_attention,
        select_blocks,
        trainable_paths,
    )

    full = ctx.cuda and not ctx.quick
    B, H, G, T, K, block = (2, 16, 4, 4096, 64, 128) if full else (1, 4, 2, 256, 32, 32)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    ref_dtype = torch.float32 if dtype == torch.bfloat16 else torch.float64
    tol = TOL["bf16" if dtype == torch.bfloat16 else "fp32"]
    path = default_path(ctx.device, block, H // G)
    torch.manual_seed(0)
    q = torch.randn(B, H, T, K, device=ctx.device).to(dtype).requires_grad_(True)
    k = torch.randn(B, G, T, K, device=ctx.device).to(dtype).requires_grad_(True)
    v = torch.randn(B, G, T, K, device=ctx.device).to(dtype).requires_grad_(True)
    g = torch.randn(B, H, T, K, device=ctx.device).to(dtype)
    # every path that trains on this device (CUDA: flex, the default, and masked; a CPU: split and masked):
    # parity with dense attention under the same mask at two densities, and the first call's wall time (flex
    # compiles there); a path that raises is recorded and fails the check, the rest still runs
    parity: dict[str, Any] = {}
    paths: dict[str, dict[str, Any]] = {}
    ok = True
    for p in trainable_paths(ctx.device):
        paths[p] = {"parity": {}}
        try:
            t0 = time.perf_counter()
            torch.autograd.grad(block_sparse_attention(q, k, v, select_blocks(q, k, block, 0.5), path=p),
                                [q, k, v], g)
            if ctx.cuda:
                torch.cuda.synchronize(ctx.device)
            paths[p]["first_call_s"] = time.perf_counter() - t0
            for d in (0.5, 0.25):
                sel = select_blocks(q, k, block, d)
                y = block_sparse_attention(q, k, v, sel, path=p)
                got = [y, *torch.autograd.grad(y, [q, k, v], g)]
                leaves = [t.detach().to(ref_dtype).requires_grad_(True) for t in (q, k, v)]
                y_ref = dense_block_attention(*leaves, sel)
                want = [y_ref, *torch.autograd.grad(y_ref, leaves, g.to(ref_dtype))]
                errs = {n: _errs(a, b) for n, a, b in zip(("y", "dq", "dk", "dv"), got, want)}
                paths[p]["parity"][str(d)] = errs
                ok &= all(_within(e, tol) for e in errs.values())
        except Exception as e:  # noqa: BLE001 - recorded: the check fails, the rest of it still runs
            paths[p]["error"] = f"{type(e).__name__}: {e}"[:1000]
            ok = False
    parity = paths[path]["parity"]
    flex = paths.get("flex", {})

    def dense() -> None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(y, [q, k, v], g)

    def sparse(d: float, on: str | None = None) -> Callable[[], None]:
        def run() -> None:
            y = block_sparse_attention(q, k, v, select_blocks(q, k, block, d), path=on)
            torch.autograd.grad(y, [q, k, v], g)
        return run

    def form(d: float, expand: bool) -> Callable[[], None]:
        sel = select_blocks(q, k, block, d)

        def run() -> None:
            y = masked_block_attention(q, k, v, sel, expand_kv=expand)
            torch.autograd.grad(y, [q, k, v], g)
        return run

    # the masked path's two forms of grouped-query attention (selection outside the timed call), beside the
    # default path and dense in the same rotation
    forms = {f"{n}:{d}": form(d, n == "expanded") for d in FORM_DENSITIES for n in ("grouped", "expanded")}
    # the device's other trainable paths beside the default (CUDA: "masked" beside "flex"), selection included
    others = [p for p in paths if p != path and "error" not in paths[p]]
    other_fns = {f"{p}:{d}": sparse(d, p) for p in others for d in SPARSE_DENSITIES}
    fns = {"dense": dense, **{str(d): sparse(d) for d in SPARSE_DENSITIES}, **forms, **other_fns}
    if ctx.cuda:
        times = _time_events(fns, warmup=3, repeats=10 if full else 5)
    else:
        times = time_interleaved(fns, warmup=1, repeats=3, device=ctx.device)
    x_dense = {d: times[d].median / times["dense"].median for d in fns if d != "dense"}
    if ctx.cuda and "flex" in others + [path] and "error" not in flex:
        # graphs compiled so far: one forward/backward pair per shape means no recompiles as the densities moved
        from torch._dynamo.utils import counters
        flex["dynamo_unique_graphs"] = counters["stats"]["unique_graphs"]
        flex["parts"] = _sparse_parts(q, k, v, g, block, 0.5)
        flex["lengths"] = _sparse_lengths(ctx, H, G, K, block) if full else {}
    at_half = {"dense": dense, path: sparse(0.5), **{f"{p}:0.5": sparse(0.5, p) for p in others}, **forms}
    peaks = {n: _act_peak_mb(ctx, fn) for n, fn in at_half.items()} if ctx.cuda else {}
    backends = _sdpa_backends(q, k, v, block)
    # the scheme's start-up fit of its two cost constants on this device, at a model of these heads
    cfg = from_dict({"model": {"dim": H * K, "n_layers": 2, "n_heads": H, "n_kv_heads": G, "ffn_dim": 3 * H * K,
                               "max_seq_len": T},
                     "moe": {"num_experts": 0}, "data": {"seq_len": T, "batch_size": B},
                     "train": {"precision": "bf16" if ctx.cuda else "fp32"}})
    factors = measure_attention_factors(cfg, block, B * T, ctx.device, repeats=5 if full else 2)
    fit: dict[str, Any] = {"factors": dict(zip(map(str, SPARSE_DENSITIES), factors))}
    try:
        fit["attn_weight"], fit["overhead"] = fit_attention_factors(cfg, block, factors)
    except ValueError as e:
        fit["not_fitted"] = str(e)
    res: dict[str, Any] = {"ok": ok, "shape": {"B": B, "H": H, "G": G, "T": T, "K": K, "block": block},
                           "dtype": str(dtype).replace("torch.", ""), "path": path, "tolerance": tol,
                           "parity": _round(parity), "timing": "cuda events" if ctx.cuda else "wall clock",
                           "times_s": {n: t.to_dict() for n, t in times.items()}, "x_dense": x_dense,
                           "act_peak_mb": peaks, "sdpa_backends": backends, "paths": paths, "startup_fit": fit,
                           "skipped": []}
    if not full:
        res["skipped"].append("full shape: skipped: 4,096 tokens, 16 heads of 64, blocks of 128 run on CUDA "
                              "without --quick")
    if not ctx.cuda:
        res["skipped"].append("activation peak: skipped: the allocator's peak is CUDA's")
        res["skipped"].append("flex path: skipped: FlexAttention has no backward on a CPU (its forward is tested "
                              "in tests/unit/test_sparse_attention.py)")
    worst = max(e["rel_norm"] for p in parity.values() for e in p.values())
    constants = (f"w {fit['attn_weight']:.2f}, o {fit['overhead']:.2f}" if "attn_weight" in fit
                 else "not fitted")
    res["summary"] = (f"{path} path, worst rel-norm error {worst:.2e} (tol {tol['rel_norm']:g}); x dense at "
                      f"density 0.5 {x_dense['0.5']:.2f}, 0.25 {x_dense['0.25']:.2f} (masked grouped / expanded "
                      f"{x_dense['grouped:0.5']:.2f} / {x_dense['expanded:0.5']:.2f}"
                      + "".join(f", {p} {x_dense[f'{p}:0.5']:.2f}" for p in others)
                      + "".join(f", {p} FAILED: {r['error'][:80]}" for p, r in paths.items() if "error" in r)
                      + f"); start-up fit {constants}")
    return _round(res)


# ---- 11. sparse_attention_train --------------------------------------------------------------------------------

SPARSE_WALK = ["dynamism.scheme=sparse_attention", "dynamism.sparse_attention.budget=random_walk",
               "dynamism.sparse_attention.start=2", "dynamism.sparse_attention.walk_step=0.1",
               "dynamism.sparse_attention.costs=given"]
"""The scheme as the check trains it: the random walk from step 3 (layers dense before), the given cost constants
(check 10 times the start-up fit)."""


def check_sparse_attention_train(ctx: Ctx) -> dict[str, Any]:
    """`moebal train --dynamism sparse_attention` on one device (a one-stage pipeline, docs/dynamism.md): the
    random walk's densities in [0.1, 0.5] against the same run held at density 1 (the same trainer, micro-batches
    and attention module, the dense causal core), one after the other: finite losses, densities below 1 from the
    first active step, each run's median step time after its first active steps (FlexAttention compiles at the
    first sparse step). Default model, rows of 16,384 tokens, blocks of 128 (where check 10 measured the kernel
    below dense on an H200); on a CPU the tiny model."""
    steps = 6 if ctx.quick else 24
    shape = (TINY + ["dynamism.sparse_attention.block=8"] if ctx.quick else
             GPU_TRAIN + ["data.seq_len=16384", "model.max_seq_len=16384", "data.batch_size=1",
                          "dynamism.sparse_attention.block=128"])
    common = shape + COMMON_TRAIN + SPARSE_WALK + ["pipeline.micro_batches=1"]
    base = ctx.workdir / "sparse_train"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    runs: dict[str, Any] = {}
    for name, bounds in (("sparse", ("0.1", "0.5")), ("dense", ("1", "1"))):
        out = base / name
        summary = _train(ctx, out, steps, common + [f"dynamism.sparse_attention.min_density={bounds[0]}",
                                                   f"dynamism.sparse_attention.max_density={bounds[1]}"],
                         resume=False, deterministic=False)
        recs = _records(out)
        settled = [r["step_time_s"] for r in recs if r["step"] > min(steps - 2, 4)]
        runs[name] = {"losses": [r["loss"] for r in recs], "densities": [r["attention_density"] for r in recs],
                      "median_step_s": statistics.median(settled), "first_step_s": recs[0]["step_time_s"],
                      "tokens_per_s": summary.get("tokens_per_s"), "wall_s": summary["wall_s"]}
    sparse, dense = runs["sparse"], runs["dense"]
    active = sparse["densities"][2:]
    finite = all(math.isfinite(v) for r in runs.values() for v in r["losses"])
    walked = bool(active) and all(min(d) >= 0.1 and max(d) <= 0.5 for d in active)
    held = all(d == [1.0] * len(d) for d in dense["densities"])
    ratio = sparse["median_step_s"] / dense["median_step_s"]
    res: dict[str, Any] = {"ok": finite and walked and held, "steps": steps, "overrides": common,
                           "runs": runs, "sparse_over_dense_step": ratio}
    if not res["ok"]:
        res["error"] = (f"losses finite {finite}, densities in [0.1, 0.5] after step 2 {walked}, dense run held "
                        f"at 1 {held}")
    res["summary"] = (f"losses finite {finite}, walk {'in' if walked else 'NOT in'} [0.1, 0.5]; median step "
                      f"sparse {sparse['median_step_s'] * 1e3:.0f} ms, dense {dense['median_step_s'] * 1e3:.0f} ms "
                      f"({ratio:.2f}x)")
    return _round(res)


# ---- 12. pipeline_syncs ---------------------------------------------------------------------------------------

PIPE_SCHEMES = {"moe": {}, "sparse_attention": {"budget": "random_walk", "min_density": 0.2, "max_density": 0.6,
                                                "walk_step": 0.2, "start": 1, "costs": "given"}}


def check_pipeline_syncs(ctx: Ctx) -> dict[str, Any]:
    """Host syncs inside a pipeline step on this device (docs/gpu.md, "The MoE path: host syncs"): a one-stage
    pipeline in this process (no process group), per scheme 3 steps (compilation, warm-up), then one step's
    schedule and one whole step inside `_count_syncs`. The schedule's budget is 0 with the `moe` scheme and
    grouped_mm experts on one device (CUDA sync debug mode on a GPU, `moebal.sync.audit`'s Python-level reads on
    a CPU); sparse attention's schedule and both whole steps are reported."""
    from moebal.config import load
    from moebal.distributed.groups import ParallelDims
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.runner import PipelineRunner

    shape = TINY if ctx.quick else GPU_TRAIN + ["data.seq_len=2048", "model.max_seq_len=2048", "data.batch_size=4"]
    schemes: dict[str, Any] = {}
    for name, options in PIPE_SCHEMES.items():
        if name == "sparse_attention":
            options = {**options, "block": 8 if ctx.quick else 128}
        cfg = load(overrides=[*shape, "moe.kernel=grouped_mm", "pipeline.micro_batches=2", "train.eval_every=0",
                              f"dynamism.scheme={name}"])
        dims = ParallelDims(world_size=1, rank=0, pp=1, ep=1, device=ctx.device).init()
        runner = PipelineRunner(cfg, scheme=build_dynamism(name, options, cfg=cfg), dims=dims, device=ctx.device)
        try:
            for _ in range(3):
                runner.train_step()
            work, count = runner._next_input()
            runner.step += 1
            runner.scheme.begin_step(runner.step)
            runner.engine.profiler = None  # a profiled step times its layers with synchronising clocks, by design
            engine: dict[str, Any] = {}
            with _count_syncs(ctx.device, engine):
                runner._run_engine(work, count)
            whole: dict[str, Any] = {}
            with _count_syncs(ctx.device, whole):
                runner.train_step()
        finally:
            runner.close()
        schemes[name] = {"engine": engine, "step": whole}

    def syncs(part: dict[str, Any], every_read: bool) -> int:
        """CUDA: the synchronising calls. CPU: the audit's `to_host` reads, and with `every_read` its other
        Python-level reads too (the step's bookkeeping reads host tensors, which are not syncs on a GPU)."""
        if ctx.cuda:
            return int(part["cuda_syncs"])
        return sum(part.get("audit_counted", {}).values()) + (len(part.get("audit_unaccounted", [])) if every_read
                                                               else 0)

    table = {n: {"engine": syncs(v["engine"], True), "step": syncs(v["step"], False)} for n, v in schemes.items()}
    res: dict[str, Any] = {"schemes": schemes, "syncs": table, "skipped": [],
                           "budget": "0 host syncs in the moe scheme's schedule (F and B ops) on one device",
                           "ok": table["moe"]["engine"] == 0}
    if not ctx.cuda:
        res["skipped"].append("cuda sync debug mode: skipped: needs CUDA (CPU counts are moebal.sync.audit's)")
    res["summary"] = (f"schedule syncs moe {table['moe']['engine']} (budget 0), sparse_attention "
                      f"{table['sparse_attention']['engine']}; whole step moe {table['moe']['step']}, "
                      f"sparse_attention {table['sparse_attention']['step']}")
    return res


# ---- 13. padded_schemes ----------------------------------------------------------------------------------------

def _padded_model(ctx: Ctx) -> tuple[Any, Any, list[int], int]:
    """(config, fp32 model on the CPU with MoD routers, real tokens per row, padded length) of the padded checks."""
    from moebal.config import load
    from moebal.dynamism.scheme import build_dynamism
    from moebal.models import build_model

    dim, T = (64, 32) if ctx.quick else (512, 1024)
    cfg = load(overrides=[f"model.dim={dim}", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
                          f"model.ffn_dim={2 * dim}", f"model.max_seq_len={T}", "moe.num_experts=0",
                          f"data.seq_len={T}", "train.precision=fp32"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    build_dynamism("mod", {"capacity": 0.25, "every": 2, "first_layer": 1}, cfg=cfg).prepare_model(model)
    return cfg, model, [T, T - 1, T // 2 + 3, 1, T // 3], T


def check_padded_schemes(ctx: Ctx) -> dict[str, Any]:
    """The schemes on padded micro-batches and pruning's global top-k on the device (docs/dynamism.md):
    - MoD on rows of 5 lengths (`ROW_TOKENS`): the routed layer's output on the device against the CPU (fp32),
      the selection (`padded_selection`) equal, and its host syncs (budget 0: the plan's numbers are host values);
    - early exit on the same rows: the survival counts (real tokens only) equal to the CPU's, one named read per
      layer (the one the path choice needs);
    - pruning's `distributed_keep_masks` (one rank: the radix select on the device's bit patterns, histograms,
      ties in model order) against `global_magnitude_masks` on the CPU, bit for bit, on coarse values with many
      ties and on random ones."""
    import copy

    from moebal.dynamism.mod import padded_selection
    from moebal.dynamism.pruning import distributed_keep_masks, global_magnitude_masks
    from moebal.dynamism.scheme import ROW_TOKENS, build_dynamism
    from moebal.pipeline.p2p import PipeChain

    dev = ctx.device
    cfg, model, n, T = _padded_model(ctx)
    n_B = torch.tensor(n, dtype=torch.int64)
    on_dev = copy.deepcopy(model).to(dev)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(len(n), T, cfg.model.dim, generator=g)
    res: dict[str, Any] = {"skipped": [], "rows": n}
    # MoD
    mod = build_dynamism("mod", {"capacity": 0.25, "every": 2, "first_layer": 1}, cfg=cfg)
    mod.begin_step(1)
    outs = []
    for m, x in ((model, h), (on_dev, h.to(dev))):
        cos, sin = m.model.rotary(T, x.dtype)
        layer = m.model.layers[1]
        rec: dict[str, Any] = {}
        with torch.no_grad(), _count_syncs(x.device, rec):
            sel = padded_selection(layer.mod_router(x).squeeze(-1), 0.25, n_B)
            out = mod.layer_forward(1, layer, x, cos, sin, {ROW_TOKENS: n_B})
        outs.append((sel.cpu(), out.cpu(), rec))
    same_sel = bool(torch.equal(outs[0][0], outs[1][0]))
    real = torch.arange(T)[None, :] < n_B[:, None]
    errs = _errs(outs[1][1][real], outs[0][1][real])
    mod_syncs = outs[1][2]["cuda_syncs"] if ctx.cuda else outs[1][2].get("audit_syncs")
    res["mod"] = {"same_selection": same_sel, "errors": _round(errs), "syncs": outs[1][2]}
    # early exit
    counts, reads = [], []
    for m, x in ((model, h), (on_dev, h.to(dev))):
        ee = build_dynamism("early_exit", {"threshold": 0.9, "first_layer": 1}, cfg=cfg)
        ee.begin_step(1)
        cos, sin = m.model.rotary(T, x.dtype)
        carry = {**ee.init_carry(len(n), T, x.device, n_B), ROW_TOKENS: n_B}
        rec = {}
        with torch.no_grad(), _count_syncs(x.device, rec):
            for i, layer in enumerate(m.model.layers):
                x = ee.layer_forward(i, layer, x, cos, sin, carry)
        counts.append(ee.tokens_in.tolist())
        reads.append(rec.get("audit_counted", {}))
    res["early_exit"] = {"tokens_in_cpu": counts[0], "tokens_in_device": counts[1], "reads": reads[1]}
    ee_ok = counts[0] == counts[1] and counts[1][-1] == sum(n) and reads[1] == {"early exit: active tokens": 4}
    # pruning's global top-k
    gp = torch.Generator().manual_seed(2)
    sizes = [(32, 16), (4, 8, 6), (16,)] if ctx.quick else [(512, 256), (8, 256, 128), (256,)]
    top: dict[str, Any] = {}
    for kind in ("coarse", "random"):
        layers = [[(torch.randint(-3, 4, s, generator=gp).float() if kind == "coarse" else torch.randn(s, generator=gp))
                   for s in sizes] for _ in range(3)]
        total = sum(w.numel() for ws in layers for w in ws)
        for keep in (0, total // 10, total // 2, total):
            got = distributed_keep_masks({i: [w.to(dev) for w in ws] for i, ws in enumerate(layers)}, keep,
                                         PipeChain([0], 0), 3)
            want = global_magnitude_masks(layers, keep)
            top[f"{kind} keep {keep}"] = all(torch.equal(got[i][j].cpu(), want[i][j]) for i in range(3)
                                             for j in range(len(sizes)))
    res["prune_top_k"] = top
    res["ok"] = same_sel and _within(errs, TOL["fp32"]) and (not ctx.cuda or mod_syncs == 0) and ee_ok and all(
        top.values())
    if not ctx.cuda:
        res["skipped"].append("the device against the CPU: skipped: needs CUDA (both sides ran on the CPU)")
    res["summary"] = (f"MoD padded selection {'equal' if same_sel else 'DIFFERS'}, output rel {errs['rel_norm']:.1e}, "
                      f"syncs {mod_syncs}; early exit counts {'equal' if counts[0] == counts[1] else 'DIFFER'}; "
                      f"pruning top-k {sum(top.values())}/{len(top)} bit for bit")
    return res


def _generate_models(ctx: Ctx) -> dict[str, Any]:
    """The generate check's fp32 models on the CPU: grouped-query MoE with a window, MLA with YaRN, and MoD with
    causal predictors (MoE, served after a step at capacity 0.25)."""
    from moebal.config import from_dict
    from moebal.dynamism.scheme import build_dynamism
    from moebal.models import build_model

    dim = 64 if ctx.quick else 512
    base: dict[str, Any] = {"model": {"vocab_size": 256, "dim": dim, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2,
                                      "ffn_dim": 2 * dim, "max_seq_len": 64, "sliding_window": 12},
                            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": dim}, "data": {"seq_len": 64}}
    mla = {"q_lora_rank": dim // 2, "kv_lora_rank": dim // 2, "qk_nope_head_dim": dim // 8,
           "qk_rope_head_dim": dim // 16, "v_head_dim": dim // 8}
    shapes = {"gqa_window": base,
              "mla": {**base, "model": {**base["model"], "n_kv_heads": 8, "sliding_window": None, "mla": mla,
                                        "rope_scaling": {"factor": 4.0, "original_max_seq_len": 16}}},
              "mod_predictor": {**base, "model": {**base["model"], "sliding_window": None}}}
    out = {}
    for name, data in shapes.items():
        cfg = from_dict(data)
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        if name == "mod_predictor":
            mod = build_dynamism("mod", {"capacity": 0.25, "every": 2, "first_layer": 1, "predictor": 16}, cfg=cfg)
            mod.prepare_model(model)
            mod.serve(model, 9)
        out[name] = model
    return out


def check_generate(ctx: Ctx) -> dict[str, Any]:
    """The KV-cached decoder on the device (moebal/models/generate.py, docs/generate.md): a 9-token prompt, then 15
    positions decoded one by one, for grouped-query MoE attention with a sliding window, multi-head latent
    attention (its latent cache and its per-head one) and Mixture-of-Depths routed by its causal predictors:
    - fp32 logits within fp32 tolerance of the model's forward over the 24 positions on the device (under the
      same routing), and of the CPU's cached logits (CUDA);
    - bf16: MLA's latent cache against its per-head one, within bf16 tolerance;
    - host syncs of one cached decode step of the grouped-query model (reported);
    - decode tokens/s of the default model with the cache and by the whole prefix (wall clock of one run each,
      cache first; on CUDA only)."""
    import copy

    from moebal.models.generate import KVCache, cached_forward, causal_routing, dropless, generate_many

    dev = ctx.device
    res: dict[str, Any] = {"skipped": []}
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    worst: dict[str, float] = {}

    def decode(model: Any, x: torch.Tensor, latent: bool = True) -> torch.Tensor:
        cache = KVCache.empty(len(model.model.layers), x.shape[1], latent=latent)
        with torch.no_grad(), dropless(model), causal_routing(model):
            parts = [cached_forward(model, x[:, :9], cache)] + [cached_forward(model, x[:, t:t + 1], cache)
                                                                for t in range(9, x.shape[1])]
        return torch.cat(parts, dim=1).float().cpu()

    ok = True
    for name, cpu_model in _generate_models(ctx).items():
        model = copy.deepcopy(cpu_model).to(dev)
        x = ids.to(dev)
        with torch.no_grad(), dropless(model), causal_routing(model):
            full = model(x).logits.float().cpu()
        forms = (True, False) if name == "mla" else (True,)
        for latent in forms:
            key = name + ("" if name != "mla" else " latent" if latent else " per-head")
            got = decode(model, x, latent)
            e = _errs(got, full)
            res[key] = {"vs_forward": _round(e)}
            ok = ok and _within(e, TOL["fp32"])
            worst[key] = e["rel_max"]
            if ctx.cuda:
                e_cpu = _errs(got, decode(cpu_model, ids, latent))
                res[key]["vs_cpu"] = _round(e_cpu)
                ok = ok and _within(e_cpu, TOL["fp32"])
        if name == "mla":
            half = copy.deepcopy(cpu_model).to(device=dev, dtype=torch.bfloat16)
            e_bf16 = _errs(decode(half, x, True), decode(half, x, False))
            res["mla bf16 latent vs per-head"] = _round(e_bf16)
            ok = ok and _within(e_bf16, TOL["bf16"])
        if name == "gqa_window":
            cache = KVCache.empty(4, 24)
            rec: dict[str, Any] = {}
            with torch.no_grad(), dropless(model):
                cached_forward(model, x[:, :9], cache)
                with _count_syncs(dev, rec):
                    cached_forward(model, x[:, 9:10], cache)
            res["decode_step_syncs"] = rec
    if ctx.cuda:
        from moebal.config import Config
        from moebal.models import build_model

        torch.manual_seed(0)
        model = build_model(Config()).eval().to(dev)
        prompt = ids[0, :16].tolist()
        rates = {}
        for how, cache in (("cache", True), ("no_cache", False)):
            generate_many(model, [prompt], 8, cache=cache)  # warm-up
            torch.cuda.synchronize(dev)
            g = generate_many(model, [prompt], 64, cache=cache)[0]
            rates[how] = round(g.tokens_per_s, 1)
        res["default_model_tokens_per_s"] = rates
    else:
        res["skipped"].append("the device against the CPU and decode tokens/s: skipped: needs CUDA")
    res["ok"] = ok
    res["summary"] = ("cached logits against the forward, largest rel error: "
                      + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
                      + (f"; tokens/s cache {res['default_model_tokens_per_s']['cache']}, whole prefix "
                         f"{res['default_model_tokens_per_s']['no_cache']}" if ctx.cuda else ""))
    return res


# ---- the runner ------------------------------------------------------------------------------------------------

CHECKS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "env": check_env,
    "nccl_smoke": check_nccl_smoke,
    "grouped_gemm": check_grouped_gemm,
    "moe_layer": check_moe_layer,
    "train_resume": check_train_resume,
    "expert_kernel_vs_dense": check_expert_vs_dense,
    "recompute": check_recompute,
    "memory_plan": check_memory_plan,
    "grad_accum": check_grad_accum,
    "sparse_attention": check_sparse_attention,
    "sparse_attention_train": check_sparse_attention_train,
    "pipeline_syncs": check_pipeline_syncs,
    "padded_schemes": check_padded_schemes,
    "generate": check_generate,
}


def run_check(name: str, ctx: Ctx) -> dict[str, Any]:
    t0 = time.perf_counter()
    if ctx.left() <= 0:
        res: dict[str, Any] = {"ok": False, "error": f"not run: the {BUDGET_S:g} s budget was spent before it"}
    else:
        try:
            res = CHECKS[name](ctx)
        except Exception as e:  # noqa: BLE001 - each check is independent: record and go on
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "traceback": _tail(traceback.format_exc())}
    res.setdefault("ok", False)
    res.setdefault("skipped", [])
    res["status"] = "passed" if res["ok"] else "failed"
    if res.get("skip_reason"):
        res["status"] = "skipped"
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    _free(ctx)
    return res


def print_table(report: dict[str, Any]) -> None:
    rows = [("check", "status", "wall s", "summary")]
    for name, r in report["checks"].items():
        summary = r.get("summary") or r.get("error", "")
        if r["status"] == "failed" and r.get("error"):
            summary = f"{summary} | {r['error']}" if r.get("summary") else r["error"]
        rows.append((name, r["status"] + (" (+skips)" if r["skipped"] else ""), f"{r['wall_s']:.1f}",
                     summary.splitlines()[0][:160] if summary else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])
    for name, r in report["checks"].items():
        for s in r["skipped"]:
            print(f"  {name}: {s}")
    print(f"gpu_check: {'all passed' if report['ok'] else 'FAILED: ' + ', '.join(report['failed'])} "
          f"on {report['device']} in {report['total_s']:.0f} s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA when available, else the CPU")
    p.add_argument("--quick", action="store_true", help="small shapes and few steps (the CI form)")
    p.add_argument("--json", metavar="PATH", help="write the full report here")
    p.add_argument("--only", metavar="NAMES", help=f"comma-separated subset of: {', '.join(CHECKS)}")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="stop starting checks after this many seconds")
    p.add_argument("--workdir", metavar="DIR", help="scratch directory (default: a fresh temporary one)")
    p.add_argument("--worker", choices=["smoke"], help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.budget_s > 0:
        p.error(f"--budget-s must be positive (seconds the checks may start within); got {args.budget_s}")
    return args


def _report(args: argparse.Namespace, argv: list[str] | None, dev: torch.device, t0: float,
            checks: dict[str, Any]) -> dict[str, Any]:
    failed = [n for n, r in checks.items() if r["status"] == "failed"]
    return {"script": "scripts/gpu_check.py", "argv": sys.argv[1:] if argv is None else argv,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "device_type": dev.type,
            "quick": args.quick, "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), "total_s": round(time.perf_counter() - t0, 1), "budget_s": args.budget_s,
            "ok": not failed, "failed": failed,
            "skipped": [f"{n}: {s}" for n, r in checks.items() for s in r["skipped"]], "checks": checks}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "smoke":
        return _smoke_worker(args.device, Path(args.worker_out))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    names = list(CHECKS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"gpu_check: --only: unknown check(s) {unknown}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                       else "cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons in true fp32
    t0 = time.perf_counter()
    checks: dict[str, Any] = {}
    report = _report(args, argv, dev, t0, checks)
    with contextlib.ExitStack() as stack:
        workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="moebal-gpu-check-")))
        workdir.mkdir(parents=True, exist_ok=True)
        ctx = Ctx(device=dev, quick=args.quick, deadline=t0 + args.budget_s, workdir=workdir)
        for n in names:
            checks[n] = run_check(n, ctx)
            print(f"gpu_check: {n}: {checks[n]['status']} ({checks[n]['wall_s']:.1f} s)", file=sys.stderr, flush=True)
            report = _report(args, argv, dev, t0, checks)
            if args.json:  # after every check: a run cut short still leaves what it found
                Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    print_table(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
