"""Validate the simulator out of sample: predicted vs measured step time of real moebal runs on this machine.

    python scripts/validate_simulator.py [--json FILE] [--png FILE] [--rounds 5] [--quick]
    python scripts/validate_simulator.py --pool run1.json run2.json     # the figures over several runs

The machine is shared, so the calibration runs inside the validation: calibration probes (GEMMs by shape and
layout, elementwise kernels, SDPA, moebal's expert kernel, AdamW, per-kernel overhead, gloo collectives) run
round-robin with the workloads (each round calls every probe and every workload once, in a rotated order), so
both see the same background load. The hardware profile is fitted from the probes' medians alone and predicts
the workloads, which it never saw. One probe is an expert-parallel step of a probe-shaped model (`PROBE_EP`):
the simulator's shortfall on it per MoE layer pass is `moe_pass_overhead_s`, used for the `ep` and `scheduled`
predictions.

Out of sample by construction: every probe dimension (GEMM rows, columns and inner dimension, SDPA sequence
and head size, expert width) comes from PROBE_DIMS, whose members are 16 mod 32 and at least 48, while every
weight dimension of a workload (model width, FFN widths, head sizes, vocabulary) is a multiple of 32 or a
number of experts (< 48); each GEMM has at least two weight dimensions among its three, so no probe GEMM shape
(M, K, N) can equal a workload's. Collective probes use payloads from PROBE_COLL_BYTES (decimal sizes, not the
binary MB multiples the workloads use). The script also checks it for real: one untimed call of every probe
and every workload runs under a recorder of the GEMMs (aten mm/addmm/bmm), SDPA calls and collectives
(payload bytes per rank) actually executed, and the run stops if a probe shape or collective size equals a
workload's (`disjointness` in the summary lists the counts).

Workloads (runs), each one training step (forward, backward, AdamW) timed per round:
- `single`: one process (dense and MoE models; MoE predictions replay the measured routing counts);
- `ep`: expert parallel on 2 gloo ranks, static and replicated placements (moebal's own Trans/Agg), the
  gradient sync after the backward (scheduler mode off);
- `scheduled`: the same on Lina's communication scheduler (`scheduler.mode: lina`: gradient all-reduce in
  chunks held back while an all-to-all is queued, all-to-alls in token chunks);
- `pipeline`: moebal's pipeline runner on 2 stages (`--pp 2`; 1F1B and GPipe), dense and with MoE layers
  inside the stages (ep 1: each stage holds all experts of its layers; routing counts replayed);
- `collective`: gloo collectives with uneven splits (not step times: reported apart).

Figures: every (run, round) sample is compared with the run's prediction; the summary gives the median and
90th percentile of |error| over all samples of all step runs, the Spearman rank correlation between predicted
and measured step times (over all samples, and over the runs' medians), and the same per mode. Every record
carries its config, mode, measured and predicted seconds, error and the 1-minute load average at each sample.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from moebal.commands.bench import add_device_argument, script_device

CPU_ONLY = "it validates the simulator against runs on this machine's cores (gloo ranks)"
"""Why `--device` accepts cpu only here."""

PROBE_DIMS = (48, 80, 176, 336, 720, 1360, 2800)
"""Every probe dimension: 16 mod 32 and >= 48, so none is a workload weight dimension (see the docstring)."""
PROBE_GEMM = [(m, n, k) for m in (80, 336, 1360, 2800) for n, k in ((176, 176), (720, 336), (336, 720),
                                                                      (1360, 720), (720, 1360))]
"""(rows m, out n, in k) of the GEMM probes (each timed in its three layouts: forward, dgrad, wgrad)."""
PROBE_ATTN = [(1, 4, 336, 48), (2, 6, 720, 80), (4, 4, 176, 80)]
"""(batch, heads, seq, head_dim) of the SDPA probes."""
PROBE_EXPERTS = [(8, 1360, 336, 720), (16, 2800, 176, 336), (4, 720, 336, 1360)]
"""(experts, rows, dim, ffn) of the expert-kernel probes."""
PROBE_COLL_BYTES = [40_000, 200_000, 1_000_000, 5_000_000, 13_000_000]
"""Collective probe payloads (bytes per rank); the workloads' are binary multiples or tensor sizes."""
PROBE_EP: dict[str, Any] = {
    "name": "probe ep moe d336 E6", "mode": "ep", "shape": "probe", "batch": 2, "seq": 176, "placement": "static",
    "model": {"dim": 336, "n_layers": 2, "n_heads": 6, "n_kv_heads": 6, "ffn_dim": 720},
    "moe": {"num_experts": 6, "top_k": 2, "expert_ffn_dim": 176}}
"""The expert-parallel probe: a static-placement EP step (2 ranks) of a model built from probe dimensions (and
6 experts, a count no workload uses, so its count exchange and statistics payloads differ too). The
simulator's shortfall on it, per MoE layer pass, is the fitted `moe_pass_overhead_s`."""
QUICK_GEMM = [(m, n, k) for m in (80, 1360) for n, k in ((176, 176), (720, 336), (1360, 720))]

SHAPES: dict[str, dict[str, Any]] = {
    "dense d256 L4": {"model": {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 768},
                      "moe": {"num_experts": 0}},
    "dense d512 L2": {"model": {"dim": 512, "n_layers": 2, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 1536},
                      "moe": {"num_experts": 0}},
    "dense d384 L6": {"model": {"dim": 384, "n_layers": 6, "n_heads": 6, "n_kv_heads": 6, "ffn_dim": 1024},
                      "moe": {"num_experts": 0}},
    "moe d256 L4 E8 k2": {"model": {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 768},
                          "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_dim": 512}},
    "moe d384 L2 E4 k1": {"model": {"dim": 384, "n_layers": 2, "n_heads": 6, "n_kv_heads": 6, "ffn_dim": 1024},
                          "moe": {"num_experts": 4, "top_k": 1, "expert_ffn_dim": 1024}},
    "moe d128 L6 E16 k2": {"model": {"dim": 128, "n_layers": 6, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 384},
                           "moe": {"num_experts": 16, "top_k": 2, "expert_ffn_dim": 256}},
    "moe d256 L2 E4 k2": {"model": {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 768},
                          "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 512}},
    "moe d384 L2 E8 k2": {"model": {"dim": 384, "n_layers": 2, "n_heads": 6, "n_kv_heads": 6, "ffn_dim": 1024},
                          "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_dim": 768}},
}
"""Model shapes of the workloads: every weight dimension a multiple of 32 (or a number of experts)."""


def _case(mode: str, shape: str, batch: int, seq: int, **extra: Any) -> dict[str, Any]:
    tag = " ".join(f"{k}={v}" for k, v in extra.items())
    name = f"{mode} {shape} b{batch}x{seq}" + (f" {tag}" if tag else "")
    return {"name": name, "mode": mode, "shape": shape, **SHAPES[shape], "batch": batch, "seq": seq, **extra}


STEP_CASES: list[dict[str, Any]] = [
    _case("single", "dense d256 L4", 4, 256),
    _case("single", "dense d512 L2", 2, 512),
    _case("single", "dense d384 L6", 4, 128),
    _case("single", "moe d256 L4 E8 k2", 4, 256),
    _case("single", "moe d384 L2 E4 k1", 8, 128),
    _case("single", "moe d384 L2 E4 k1", 4, 256),
    _case("single", "moe d128 L6 E16 k2", 8, 128),
    _case("ep", "moe d256 L2 E4 k2", 4, 256, placement="static"),
    _case("ep", "moe d256 L2 E4 k2", 4, 256, placement="replicated"),
    _case("ep", "moe d384 L2 E8 k2", 2, 512, placement="static"),
    _case("ep", "moe d384 L2 E8 k2", 2, 512, placement="replicated"),
    _case("ep", "moe d128 L6 E16 k2", 8, 128, placement="static"),
    _case("ep", "moe d256 L4 E8 k2", 4, 256, placement="static"),
    _case("scheduled", "moe d256 L2 E4 k2", 4, 256, a2a_chunks=2, chunk_mb=1),
    _case("scheduled", "moe d384 L2 E8 k2", 2, 512, a2a_chunks=2, chunk_mb=1),
    _case("scheduled", "moe d128 L6 E16 k2", 8, 128, a2a_chunks=2, chunk_mb=1),
    _case("scheduled", "moe d256 L4 E8 k2", 4, 256, a2a_chunks=2, chunk_mb=1),
    _case("pipeline", "dense d256 L4", 8, 128, schedule="1f1b", micro_batches=4),
    _case("pipeline", "dense d256 L4", 4, 256, schedule="gpipe", micro_batches=4),
    _case("pipeline", "dense d384 L6", 4, 256, schedule="gpipe", micro_batches=2),
    _case("pipeline", "dense d512 L2", 4, 256, schedule="1f1b", micro_batches=2),
    _case("pipeline", "moe d256 L4 E8 k2", 8, 128, schedule="1f1b", micro_batches=4),
    _case("pipeline", "moe d128 L6 E16 k2", 8, 128, schedule="gpipe", micro_batches=2),
    _case("pipeline", "moe d384 L2 E4 k1", 4, 256, schedule="1f1b", micro_batches=2),
]
"""The step runs: 24 over 8 model shapes. `ep` and `scheduled` run on 2 gloo ranks (ep 2), `pipeline` on 2
stages (dense, and MoE layers inside the stages: each stage holds all experts of its layers, ep 1)."""
QUICK_STEPS = ("single moe d384 L2 E4 k1 b8x128", "ep moe d256 L2 E4 k2 b4x256 placement=replicated",
               "scheduled moe d256 L2 E4 k2 b4x256 a2a_chunks=2 chunk_mb=1",
               "pipeline moe d256 L4 E8 k2 b8x128 schedule=1f1b micro_batches=4")

COLL_CASES: list[dict[str, Any]] = [
    {"name": "all_to_all uneven 2 ranks 3 MB", "kind": "all_to_all", "world": 2, "split_mb": [[0.5, 2.5], [1.5, 0.3]]},
    {"name": "all_to_all uneven 3 ranks", "kind": "all_to_all", "world": 3,
     "split_mb": [[0.2, 1.6, 0.4], [0.8, 0.1, 2.0], [0.3, 0.9, 0.5]]},
    {"name": "all_to_all uneven 4 ranks", "kind": "all_to_all", "world": 4,
     "split_mb": [[0.1, 1.2, 0.3, 0.6], [0.4, 0.2, 0.2, 1.0], [0.9, 0.3, 0.1, 0.2], [0.2, 0.8, 0.5, 0.1]]},
    {"name": "all_reduce 3 ranks 3 MB", "kind": "all_reduce", "world": 3, "mb": 3.0},
    {"name": "broadcast 4 ranks 4 MB", "kind": "broadcast", "world": 4, "mb": 4.0},
    {"name": "send/recv 2 MB", "kind": "p2p", "world": 2, "mb": 2.0},
]
"""Collective runs (mode `collective`): uneven splits, binary-MB payloads."""
for _c in COLL_CASES:
    _c["mode"] = "collective"
QUICK_COLL = ("all_to_all uneven 2 ranks 3 MB",)
STEP_MODES = ("single", "ep", "scheduled", "pipeline")


def selected(quick: bool, only: str | None) -> list[dict[str, Any]]:
    """The runs of this invocation (steps, then collectives)."""
    cases = STEP_CASES + COLL_CASES
    if quick:
        cases = [c for c in cases if c["name"] in QUICK_STEPS + QUICK_COLL]
    return [c for c in cases if only is None or only in c["name"]]


def check_grid() -> None:
    """The construction argument, checked on the configured numbers: probe dimensions are 16 mod 32 and >= 48;
    workload weight dimensions are multiples of 32 or expert counts below 48."""
    probe = set(PROBE_DIMS) | {d for s in PROBE_GEMM + QUICK_GEMM for d in s} | \
        {d for s in PROBE_ATTN for d in s[2:]} | {d for s in PROBE_EXPERTS for d in s[1:]}
    bad = sorted(d for d in probe if d % 32 != 16 or d < 48)
    if bad:
        raise AssertionError(f"probe dimensions {bad} are not 16 mod 32 and >= 48")
    for shape in SHAPES.values():
        m, moe = shape["model"], shape["moe"]
        dims = [m["dim"], m["ffn_dim"], m["dim"] // m["n_heads"], moe.get("expert_ffn_dim", 32), 256]
        if any(d % 32 for d in dims) or moe["num_experts"] >= 48:
            raise AssertionError(f"workload shape {m} {moe}: a weight dimension is not a multiple of 32")


def _cfg(case: dict[str, Any], pp: int = 1) -> Any:
    from moebal.config import from_dict

    model = {**case["model"], "vocab_size": 256, "max_seq_len": case["seq"]}
    return from_dict({"model": model, "moe": {"aux_loss_coef": 0.01, **case["moe"]},
                      "data": {"seq_len": case["seq"], "batch_size": case["batch"], "max_bytes": 2_000_000},
                      "train": {"precision": "fp32", "warmup_steps": 0, "eval_every": 0},
                      "parallel": {"pp": pp, "nproc": pp}})


# ---- what a call actually runs: GEMM shapes, SDPA shapes, collective payloads ------------------------------
class ShapeLog:
    """Shapes executed under `record()`: GEMMs as (M, K, N) of A[M, K] @ B[K, N] (per batch for bmm), SDPA
    query shapes, and collective payload bytes per rank (every `torch.distributed` call, from any thread)."""

    GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")
    COLLECTIVES = ("all_reduce", "all_to_all_single", "broadcast", "send", "recv", "isend", "irecv",
                   "all_gather", "batch_isend_irecv")

    def __init__(self) -> None:
        self.gemm: set[tuple[int, int, int]] = set()
        self.attention: set[tuple[int, ...]] = set()
        self.collective: set[int] = set()

    def add_gemm(self, op: str, args: tuple[Any, ...]) -> None:
        a, b = (args[1], args[2]) if op in ("addmm", "baddbmm") else (args[0], args[1])
        self.gemm.add((int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])))

    def add_collective(self, name: str, args: tuple[Any, ...]) -> None:
        import torch

        if name == "batch_isend_irecv":
            tensors = [op.tensor for op in args[0]]
        elif name in ("all_to_all_single", "all_gather"):
            tensors = [args[1]]
        else:
            tensors = [args[0]]
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.collective.add(int(t.numel() * t.element_size()))

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        import torch.distributed as dist
        from torch.utils._python_dispatch import TorchDispatchMode

        log = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                                   kwargs: dict[str, Any] | None = None) -> Any:
                op = func.overloadpacket.__name__
                if op in ShapeLog.GEMM_OPS:
                    log.add_gemm(op, args)
                elif "scaled_dot_product" in op and "backward" not in op:
                    log.attention.add(tuple(int(s) for s in args[0].shape))
                return func(*args, **(kwargs or {}))

        saved = {n: getattr(dist, n) for n in self.COLLECTIVES if hasattr(dist, n)}

        wrapped: dict[Any, Callable[..., Any]] = {}

        def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                log.add_collective(name, args)
                return fn(*args, **kwargs)
            wrapped[call] = fn
            return call

        p2p_op = dist.P2POp

        def make_p2p_op(op: Any, *args: Any, **kwargs: Any) -> Any:
            # P2POp accepts only the real isend/irecv: hand it the original under the wrapper
            return p2p_op(wrapped.get(op, op), *args, **kwargs)

        for n, fn in saved.items():
            setattr(dist, n, wrap(n, fn))
        dist.P2POp = make_p2p_op  # type: ignore[misc,assignment]
        try:
            with _Mode():
                yield
        finally:
            for n, fn in saved.items():
                setattr(dist, n, fn)
            dist.P2POp = p2p_op  # type: ignore[misc]

    def as_json(self) -> dict[str, list[Any]]:
        return {"gemm": sorted(self.gemm), "attention": sorted(self.attention), "collective": sorted(self.collective)}


def disjointness(probe: dict[str, list[Any]], workload: dict[str, list[Any]]) -> dict[str, Any]:
    """Counts of distinct probe and workload shapes and their intersection per kind; raises AssertionError when
    a probe GEMM shape, SDPA shape or collective payload equals a workload's."""
    out: dict[str, Any] = {}
    for kind in ("gemm", "attention", "collective"):
        p = {tuple(x) if isinstance(x, list) else x for x in probe.get(kind, [])}
        w = {tuple(x) if isinstance(x, list) else x for x in workload.get(kind, [])}
        common = sorted(p & w)
        out[kind] = {"probe_shapes": len(p), "workload_shapes": len(w), "common": [list(c) if isinstance(c, tuple)
                                                                                  else c for c in common]}
        if common:
            raise AssertionError(f"calibration is not out of sample: probe {kind} shapes {common[:5]} are also "
                                 f"workload shapes")
    return out


def _merge(logs: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    out: dict[str, set[Any]] = {"gemm": set(), "attention": set(), "collective": set()}
    for log in logs:
        for k, v in log.items():
            out[k] |= {tuple(x) if isinstance(x, list) else x for x in v}
    return {k: sorted(v) for k, v in out.items()}


# ---- probes (calibration) ------------------------------------------------------------------------------------
def compute_probes(quick: bool) -> dict[str, Any]:
    """fp32 compute probes of `moebal calibrate` on the PROBE_* shapes."""
    from moebal.commands import calibrate as cal

    probes: dict[str, Any] = {}
    probes.update(cal.gemm_probes("fp32", QUICK_GEMM if quick else PROBE_GEMM))
    probes.update(cal.attention_probes("fp32", PROBE_ATTN[:1] if quick else PROBE_ATTN))
    probes.update(cal.expert_probes("fp32", PROBE_EXPERTS[:1] if quick else PROBE_EXPERTS))
    probes.update(cal.memory_probes())
    probes.update(cal.optimizer_probes())
    probes.update(cal.overhead_probes())
    return probes


# ---- workloads (each a callable running one training step or one collective) ------------------------------
def model_step(case: dict[str, Any]) -> tuple[Callable[[], Any], Any]:
    """(one forward + backward + AdamW step of a single-process moebal model, the model)."""
    import torch

    from moebal.models import build_model

    torch.manual_seed(0)
    model = build_model(_cfg(case))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (case["batch"], case["seq"] + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        out = model(ids[:, :-1], ids[:, 1:])
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model


def ep_step(case: dict[str, Any], rank: int, world: int) -> tuple[Callable[[], Any], Any, Any]:
    """(one expert-parallel step on this rank: Trans, forward, backward, Agg, gradient sync, AdamW; the model;
    the scheduler). `scheduled` runs use Lina's scheduler (mode lina, fixed chunk size and token chunks),
    `ep` runs the unscheduled sync after the backward (mode off)."""
    import torch

    from moebal.distributed.expert_parallel import ExpertParallel
    from moebal.distributed.groups import ParallelDims
    from moebal.models import build_model
    from moebal.scheduler import CommScheduler

    cfg = _cfg(case)
    torch.manual_seed(0)
    model = build_model(cfg)
    dims = ParallelDims(world_size=world, rank=rank, ep=world).init()
    lina = case["mode"] == "scheduled"
    sched = CommScheduler("lina" if lina else "off", rank=rank, timeout_s=600)
    ep = ExpertParallel(model, dims, sched, chunk_bytes=case.get("chunk_mb", 0) * float(1 << 20))
    for d in ep.dispatchers:
        d.a2a_chunks = case.get("a2a_chunks", 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_moe = sum(1 for _ in model.moe_layers())
    placements = _placements(case.get("placement", "static"), cfg.moe.num_experts, world, n_moe)
    ids = torch.randint(0, 256, (case["batch"], case["seq"] + 1), generator=torch.Generator().manual_seed(rank))
    count = [0]

    def step() -> None:
        count[0] += 1
        sched.log.begin(count[0])
        sched.start_compute()
        ep.apply(placements)
        out = model(ids[:, :-1], ids[:, 1:])
        (out.loss + out.aux_loss).backward()
        ep.aggregate()
        ep.sync_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ep.release()
        sched.settle()
        sched.log.end()

    return step, model, sched


def _placements(kind: str, E: int, R: int, layers: int) -> list[Any]:
    from moebal.planner.plan import ExpertPlacement, default_owners

    owner = default_owners(E, R)
    if kind == "static":
        return [ExpertPlacement.static(E, R) for _ in range(layers)]
    # replicate the first expert of every rank on every other rank (a fixed, replayable placement)
    per = E // R
    reps = tuple(tuple(r for r in range(R) if r != owner[e]) if e % per == 0 else () for e in range(E))
    return [ExpertPlacement(num_ranks=R, owner=owner, replicas=reps, policy="replicate") for _ in range(layers)]


def coll_fn(case: dict[str, Any], rank: int) -> Callable[[], Any]:
    import torch
    import torch.distributed as dist

    mb = 1 << 20
    if case["kind"] == "all_to_all":
        split = np.asarray(case["split_mb"]) * mb // 4
        send, recv = split[rank].astype(int).tolist(), split[:, rank].astype(int).tolist()
        x, y = torch.ones(sum(send)), torch.empty(sum(recv))
        return lambda: dist.all_to_all_single(y, x, recv, send)
    x = torch.ones(int(case["mb"] * mb // 4))
    if case["kind"] == "all_reduce":
        return lambda: dist.all_reduce(x)
    if case["kind"] == "broadcast":
        return lambda: dist.broadcast(x, 0)
    if rank > 1:
        return lambda: None
    return (lambda: dist.send(x, 1)) if rank == 0 else (lambda: dist.recv(x, 0))


def pipe_step(case: dict[str, Any], rank: int, world: int) -> tuple[Callable[[], Any], list[float], np.ndarray | None]:
    """One training step of moebal's pipeline runner (`--pp 2`: this rank's stage), 1F1B or GPipe over
    `micro_batches`; also the step times the runner itself reports (`step_time_s`, as `moebal train` logs) and,
    for an MoE model, the [n_layers, E] token-expert assignments of this stage's MoE layers summed over the
    micro-batches of the latest step (zeros for the other stage's layers; filled in place after every step)."""
    import dataclasses

    from moebal.distributed.groups import ParallelDims
    from moebal.pipeline.runner import PipelineRunner

    cfg = _cfg(case, pp=world)
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, schedule=case["schedule"],
                                                                micro_batches=case["micro_batches"]))
    dims = ParallelDims(world_size=world, rank=rank, pp=world).init()
    runner = PipelineRunner(cfg, dims=dims, record_ops=False)
    runner.start()
    reported: list[float] = []
    counts = _stage_counter(runner.stage, cfg)

    def step() -> None:
        if counts is not None:
            counts.fill(0.0)
        reported.append(float(runner.train_step()["step_time_s"]))

    return step, reported, counts


def _stage_counter(stage: Any, cfg: Any) -> np.ndarray | None:
    """[n_layers, E] counts that forward hooks on the stage's MoE layers sum every forward's routing into (None
    for a dense model). The hook runs inside the timed step: one `.numpy()` view of a CPU tensor and an
    E-element add per MoE layer and micro-batch (microseconds; no device to synchronise with here)."""
    if cfg.moe.num_experts == 0:
        return None
    out = np.zeros((cfg.model.n_layers, cfg.moe.num_experts))
    for i in stage.layer_ids:
        layer = stage.layer(i)
        if layer.is_moe:
            def hook(mod: Any, _a: Any, _o: Any, i: int = i) -> None:
                out[i] += mod.last_stats.counts_E.numpy()
            layer.block_sparse_moe.register_forward_hook(hook)
    return out


def _layer_counts(model: Any, cfg: Any) -> np.ndarray | None:
    """[n_layers, E] assignments of the last forward (zeros for dense layers)."""
    if cfg.moe.num_experts == 0:
        return None
    out = np.zeros((cfg.model.n_layers, cfg.moe.num_experts))
    moe_idx = [i for i in range(cfg.model.n_layers) if cfg.is_moe_layer(i)]
    for i, layer in zip(moe_idx, model.moe_layers()):
        out[i] = layer.last_stats.counts_E.numpy()
    return out


# ---- round-robin timing ----------------------------------------------------------------------------------------
def round_robin(fns: dict[str, Callable[[], Any]], rounds: int, sync: Callable[[], Any] | None = None
                ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(seconds, 1-minute load average) of each fn per round: every round calls each fn once in an order
    rotated by one per round; `sync` (a barrier) runs before each timed call, outside the timed region."""
    names = list(fns)
    secs: dict[str, list[float]] = {n: [] for n in names}
    loads: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            fns[name]()
            secs[name].append(time.perf_counter() - t0)
            loads[name].append(os.getloadavg()[0])
    return secs, loads


def _record_shapes(fns: dict[str, Callable[[], Any]], probe_names: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One untimed call of every fn (the warm-up) under a ShapeLog: (probe shapes, workload shapes)."""
    probe, work = ShapeLog(), ShapeLog()
    for name, fn in fns.items():
        with (probe if name in probe_names else work).record():
            fn()
    return probe.as_json(), work.as_json()


def phase_single(cases: list[dict[str, Any]], rounds: int, quick: bool) -> dict[str, Any]:
    """This process, 1 thread: fp32 compute probes interleaved with single-process training steps."""
    import torch

    from moebal.commands import calibrate as cal

    torch.set_num_threads(1)
    probes = compute_probes(quick)
    fns = {k: fn for k, (_, fn) in probes.items()}
    models = {}
    for case in cases:
        fns[case["name"]], models[case["name"]] = model_step(case)
    shapes = _record_shapes(fns, set(probes))
    secs, loads = round_robin(fns, rounds)
    counts = {c["name"]: _layer_counts(models[c["name"]], _cfg(c)) for c in cases}
    compute = cal.compute_records(probes, {k: statistics.median(v) for k, v in secs.items()})
    return {"compute": compute, "samples": {k: secs[k] for k in models}, "loads": {k: loads[k] for k in models},
            "counts": counts, "shapes": shapes, "reported": {}}


def _world_worker(rank: int, world: int, rounds: int, cases: list[dict[str, Any]], quick: bool) -> dict[str, Any]:
    """On `world` gloo ranks: collective probes (and, at 2 ranks, fp32 compute probes on both ranks at once,
    the expert-parallel, scheduled and pipeline steps) interleaved with the validation collectives."""
    import torch
    import torch.distributed as dist

    from moebal.commands import calibrate as cal

    torch.set_num_threads(1)
    probes = cal.collective_probes(rank, world, PROBE_COLL_BYTES[::2] if quick else PROBE_COLL_BYTES)
    if world == 2:
        probes.update(compute_probes(quick))
    fns = {k: fn for k, (_, fn) in probes.items()}
    probe_names = set(probes)
    ep_probe = None
    if world == 2:
        fns[PROBE_EP["name"]], ep_probe, _ = ep_step(PROBE_EP, rank, world)
        probe_names.add(PROBE_EP["name"])
    models, scheds, reported = {}, [], {}
    stage_counts: dict[str, np.ndarray] = {}
    for case in cases:
        if case["mode"] == "collective":
            fns[case["name"]] = coll_fn(case, rank)
        elif case["mode"] in ("ep", "scheduled"):
            fns[case["name"]], models[case["name"]], sched = ep_step(case, rank, world)
            scheds.append(sched)
        elif case["mode"] == "pipeline":
            fns[case["name"]], reported[case["name"]], pcounts = pipe_step(case, rank, world)
            if pcounts is not None:
                stage_counts[case["name"]] = pcounts
    shapes = _record_shapes(fns, probe_names)
    secs, loads = round_robin(fns, rounds, sync=dist.barrier)
    names = list(secs)
    t = torch.tensor([secs[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a call lasts as long as its slowest rank
    secs = {n: t[i].tolist() for i, n in enumerate(names)}
    for s in scheds:
        s.close()
    med = {k: statistics.median(v) for k, v in secs.items()}
    coll = [{**meta, "s": med[k]} for k, (meta, _) in probes.items() if k.startswith("coll")]
    return {"collective": coll, "compute": cal.compute_records(probes, med) if world == 2 else {},
            "samples": {k: v for k, v in secs.items() if k not in probe_names},
            "loads": {k: v for k, v in loads.items() if k not in probe_names}, "shapes": shapes,
            "ep_probe": None if ep_probe is None else
            {"s": med[PROBE_EP["name"]], "counts": _layer_counts(ep_probe, _cfg(PROBE_EP)).tolist()},
            "reported": {k: v[1:] for k, v in reported.items()},  # the first call is the untimed warm-up
            "counts": {k: np.asarray(_layer_counts(m, _cfg(next(c for c in cases if c["name"] == k)))).tolist()
                       for k, m in models.items()},
            "stage_counts": {k: v.tolist() for k, v in stage_counts.items()}}


def phase_world(world: int, cases: list[dict[str, Any]], rounds: int, quick: bool) -> dict[str, Any]:
    from moebal.distributed.testing import run_ranks

    res = run_ranks(_world_worker, world, rounds, cases, quick, timeout_s=1800.0)
    out: dict[str, Any] = res[0]
    out["counts"] = {k: np.stack([np.asarray(r["counts"][k]) for r in res], axis=1) for k in out["counts"]}
    # pipeline: every MoE layer lives on one stage (the others hold zeros for it); [L, E] summed over stages
    out["counts"].update({k: np.sum([np.asarray(r["stage_counts"][k]) for r in res], axis=0)
                          for k in out["stage_counts"]})
    out["shapes"] = (_merge([r["shapes"][0] for r in res]), _merge([r["shapes"][1] for r in res]))
    if out["ep_probe"] is not None:  # [L, R, E] counts of the EP probe
        out["ep_probe"]["counts"] = np.stack([np.asarray(r["ep_probe"]["counts"]) for r in res], axis=1)
    return out


# ---- predictions --------------------------------------------------------------------------------------------
def predict(case: dict[str, Any], counts: np.ndarray | None, cost: Any, world: int = 2,
            ep_overhead_s: float = 0.0) -> float:
    """The simulator's step time (or collective time) for one run; `ep_overhead_s` is the fitted host time per
    MoE layer pass of the expert-parallel runs (`SimSpec.moe_pass_overhead_s`)."""
    from moebal.planner.cost import ModelShape
    from moebal.sim.program import Layout, SimSpec
    from moebal.sim.simulate import simulate

    mode = case["mode"]
    if mode == "collective":
        return predict_coll(case, cost)
    b, T = case["batch"], case["seq"]
    if mode == "single":
        cfg = _cfg(case)
        spec = SimSpec(layout=Layout(1), micro_batch_size=b, seq_len=T, count_exchange=False)
        c = None if counts is None else counts[:, None, None, :]
        return simulate(ModelShape.from_config(cfg), cost, spec, c).iteration_time_s
    if mode == "pipeline":
        cfg = _cfg(case, pp=world)
        m = case["micro_batches"]
        spec = SimSpec(layout=Layout(world, pp=world), micro_batches=m, micro_batch_size=b // m, seq_len=T,
                       schedule=case["schedule"], count_exchange=False)
        # MoE stages (ep 1): counts [L, E] of the whole step -> [L, 1 group, 1 rank, E]; the simulator spreads
        # them evenly over the micro-batches
        c = None if counts is None else counts[:, None, None, :]
        return simulate(ModelShape.from_config(cfg), cost, spec, c).iteration_time_s
    cfg = _cfg(case)
    if counts is None:
        raise ValueError(f"{case['name']}: no routing counts")
    if mode == "ep":
        # moebal's EP step: blocking Trans before the forward, Agg after the backward, one flat all-reduce of
        # the non-expert gradients after the backward, Trans/Agg as point-to-point fan-out; the balancing
        # statistics all-reduced over the EP ranks in every MoE layer's forward and backward
        spec = SimSpec(layout=Layout(world, ep=world), micro_batch_size=b, seq_len=T, dp_overlap=False,
                       bucket_bytes=float("inf"), trans_algorithm="fanout", stats_allreduce=True,
                       moe_pass_overhead_s=ep_overhead_s)
    else:
        # Lina: gradient chunks of chunk_mb during the backward, held while an all-to-all is registered;
        # all-to-alls in a2a_chunks token chunks pipelined with the experts
        spec = SimSpec(layout=Layout(world, ep=world), micro_batch_size=b, seq_len=T, moe_schedule="lina",
                       a2a_chunks=case["a2a_chunks"], lina_priority=True, dp_overlap=True,
                       ar_chunk_bytes=case["chunk_mb"] * float(1 << 20), trans_algorithm="fanout",
                       stats_allreduce=True, moe_pass_overhead_s=ep_overhead_s)
    pls = _placements(case.get("placement", "static"), cfg.moe.num_experts, world, cfg.model.n_layers)
    return simulate(ModelShape.from_config(cfg), cost, spec, counts[:, None], [[p] for p in pls]).iteration_time_s


def predict_coll(case: dict[str, Any], cost: Any) -> float:
    w, mb = case["world"], float(1 << 20)
    topo = cost.topology(w)
    if case["kind"] == "all_to_all":
        b = np.asarray(case["split_mb"]) * mb
        np.fill_diagonal(b, 0.0)  # a rank's block for itself is a local copy
        coll = cost.all_to_all(topo, range(w), b)
    elif case["kind"] == "all_reduce":
        coll = cost.all_reduce(topo, range(w), case["mb"] * mb)
    elif case["kind"] == "broadcast":
        coll = cost.broadcast(topo, 0, range(w), case["mb"] * mb)
    else:
        coll = cost.p2p(topo, 0, 1, case["mb"] * mb)
    return float(cost.time_of(coll, topo))


# ---- statistics ---------------------------------------------------------------------------------------------
def spearman(x: Any, y: Any) -> float | None:
    """Spearman rank correlation (ties get their average rank); None when either side is constant or n < 2."""
    a, b = _ranks(np.asarray(x, dtype=np.float64)), _ranks(np.asarray(y, dtype=np.float64))
    if a.size < 2 or a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="mergesort")
    ranks = np.empty(v.size)
    ranks[order] = np.arange(v.size, dtype=np.float64)
    for u in np.unique(v):  # average rank over ties
        sel = v == u
        if sel.sum() > 1:
            ranks[sel] = ranks[sel].mean()
    return ranks


def error_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every (run, round) sample of `records`: median and 90th percentile of |error|, Spearman rank
    correlation of predicted vs measured; and the same over the runs' medians."""
    if not records:
        return {"runs": 0, "samples": 0}
    pred = [r["predicted_s"] for r in records for _ in r["samples"]]
    meas = [s["measured_s"] for r in records for s in r["samples"]]
    errs = np.abs([s["error"] for r in records for s in r["samples"]])
    run_errs = np.abs([r["error"] for r in records])
    return {"runs": len(records), "samples": int(errs.size),
            "median_abs_error": float(np.median(errs)), "p90_abs_error": float(np.percentile(errs, 90)),
            "max_abs_error": float(errs.max()), "within_15pct": float(np.mean(errs <= 0.15)),
            "spearman": spearman(pred, meas),
            "runs_median_abs_error": float(np.median(run_errs)),
            "runs_p90_abs_error": float(np.percentile(run_errs, 90)),
            "runs_spearman": spearman([r["predicted_s"] for r in records], [r["measured_s"] for r in records]),
            "mean_signed_error": float(np.mean([s["error"] for r in records for s in r["samples"]]))}


# ---- driver -------------------------------------------------------------------------------------------------
def _record(case: dict[str, Any], samples: list[float], loads: list[float], pred: float, profile: str,
            reported: list[float] | None) -> dict[str, Any]:
    meas = statistics.median(samples)
    rec = {"name": case["name"], "mode": case["mode"], "config": {k: v for k, v in case.items() if k != "name"},
           "measured_s": meas, "predicted_s": pred, "error": (pred - meas) / meas,
           "load_average": statistics.median(loads), "profile": profile,
           "samples": [{"round": i, "measured_s": s, "error": (pred - s) / s, "load_average": round(ld, 2)}
                       for i, (s, ld) in enumerate(zip(samples, loads))]}
    if reported:
        rec["runner_step_time_s"] = reported  # the pipeline runner's own step_time_s per round (rank 0)
    return rec


def _fit(single: dict[str, Any], worlds: dict[int, dict[str, Any]]) -> tuple[Any, Any]:
    """Profiles fitted from the probes' medians: 1 process busy, and 2 processes busy."""
    from moebal.planner.hardware_fit import fit_profile

    coll = [r for w in worlds.values() for r in w["collective"]]
    kw: dict[str, Any] = {"source": ["scripts/validate_simulator.py (probes only, shapes disjoint from the workloads)"],
          "calibration": {"statistic": "median"}}
    prof1 = fit_profile({**single["compute"], "collective": coll}, name="validation-1proc",
                        description="fitted in the validation run (1 process)", **kw)
    two = worlds[2]["compute"] if 2 in worlds and worlds[2]["compute"] else single["compute"]
    prof2 = fit_profile({**two, "collective": coll}, name="validation-2proc",
                        description="fitted in the validation run (2 processes busy)", **kw)
    return prof1, prof2


def fit_ep_overhead(probe: dict[str, Any], cost: Any) -> dict[str, Any]:
    """`moe_pass_overhead_s` from the EP probe alone: (its measured median step - the simulated step without the
    term) / its MoE layer passes (forward and backward of each MoE layer), floored at 0."""
    cfg = _cfg(PROBE_EP)
    sim_s = predict(PROBE_EP, np.asarray(probe["counts"]), cost)
    passes = 2 * sum(1 for i in range(cfg.model.n_layers) if cfg.is_moe_layer(i))
    return {"moe_pass_overhead_s": max(probe["s"] - sim_s, 0.0) / passes, "probe": PROBE_EP["name"],
            "probe_measured_s": probe["s"], "probe_simulated_s": sim_s, "passes": passes}


def validate(rounds: int, quick: bool, only: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(records, extra summary: fitted profiles, disjointness)."""
    from moebal.commands.calibrate import summary
    from moebal.planner.cost import CostModel

    check_grid()
    cases = selected(quick, only)
    single = phase_single([c for c in cases if c["mode"] == "single"], rounds, quick)
    worlds = {}
    for w in (2, 3, 4):
        mine = [c for c in cases if c["mode"] != "single" and c.get("world", 2) == w]
        if mine or w == 2:
            worlds[w] = phase_world(w, mine, rounds, quick)
    probe = _merge([single["shapes"][0]] + [p["shapes"][0] for p in worlds.values()])
    work = _merge([single["shapes"][1]] + [p["shapes"][1] for p in worlds.values()])
    disjoint = disjointness(probe, work)
    prof1, prof2 = _fit(single, worlds)
    cost1, cost2 = CostModel(prof1, "fp32"), CostModel(prof2, "fp32")
    ep_fit = fit_ep_overhead(worlds[2]["ep_probe"], cost2)
    records = []
    for case in cases:
        phase = single if case["mode"] == "single" else worlds[case.get("world", 2)]
        cost, prof = (cost1, prof1) if case["mode"] in ("single", "collective") else (cost2, prof2)
        counts = phase["counts"].get(case["name"])
        pred = predict(case, None if counts is None else np.asarray(counts), cost,
                       ep_overhead_s=ep_fit["moe_pass_overhead_s"])
        records.append(_record(case, phase["samples"][case["name"]], phase["loads"][case["name"]], pred,
                               prof.name, phase["reported"].get(case["name"])))
    extra = {"fitted_profiles": {"single_process": summary(prof1, prof1.name),
                                 "two_process": summary(prof2, prof2.name)},
             "disjointness": disjoint, "probe_dims": list(PROBE_DIMS), "probe_collective_bytes": PROBE_COLL_BYTES,
             "ep_overhead_fit": ep_fit}
    return records, extra


def summarise(records: list[dict[str, Any]], rounds: int, loads: list[float], wall_s: float) -> dict[str, Any]:
    steps = [r for r in records if r["mode"] in STEP_MODES]
    sample_loads = [s["load_average"] for r in records for s in r["samples"]]
    return {"rounds": rounds, "step_runs": len(steps), "model_shapes": len({r["config"]["shape"] for r in steps}),
            "steps": error_stats(steps),
            "by_mode": {m: error_stats([r for r in records if r["mode"] == m]) for m in STEP_MODES + ("collective",)},
            "all_runs": error_stats(records),
            "targets": {"median_abs_error": 0.15, "spearman": 0.9},
            "wall_s": round(wall_s, 1), "cores": os.cpu_count(),
            # other jobs on the machine: the 1-minute load average at start and end, and over every sample
            "load_average": [round(loads[0], 2), round(loads[1], 2)],
            "load_average_samples": [round(min(sample_loads), 2), round(max(sample_loads), 2)] if sample_loads else []}


def pool(paths: list[str]) -> int:
    """Print the error statistics over the records of several runs' --json files together."""
    records = []
    for path in paths:
        try:
            rows = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --pool {path}: cannot read its records ({type(e).__name__}: {e})") from None
        if not (isinstance(rows, list) and all(isinstance(r, dict) and "mode" in r for r in rows)):
            raise SystemExit(f"error: --pool {path}: not a list of this script's records (write them with --json)")
        records += rows
    steps = [r for r in records if r["mode"] in STEP_MODES]
    loads = [s["load_average"] for r in records for s in r["samples"]]
    print(json.dumps({"files": len(paths), "steps": error_stats(steps),
                      "by_mode": {m: error_stats([r for r in records if r["mode"] == m])
                                  for m in STEP_MODES + ("collective",)},
                      "load_average_samples": [min(loads), max(loads)] if loads else []}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, metavar="FILE", help="write the records (a JSON list) to FILE and the "
                    "summary, fitted profiles, disjointness check and environment to FILE with suffix .summary.json")
    ap.add_argument("--png", default=None, metavar="FILE", help="write predicted vs measured as a scatter plot")
    ap.add_argument("--rounds", type=int, default=None, help="round-robin rounds (default 5; --quick: 2)")
    ap.add_argument("--quick", action="store_true", help="one run per mode, fewer probes, 2 rounds (a smoke test)")
    ap.add_argument("--only", default=None, help="run only runs whose name contains this text")
    ap.add_argument("--pool", nargs="+", default=None, metavar="JSON", help="measure nothing: print the summary "
                    "over every record of these --json files together (several runs of the script pooled)")
    add_device_argument(ap, cpu_only=CPU_ONLY)
    args = ap.parse_args(argv)
    script_device(args.device, cpu_only=CPU_ONLY)
    if args.pool:
        return pool(args.pool)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    if rounds < 1:
        ap.error("--rounds must be at least 1")

    from moebal.kernels.bench import environment

    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    records, extra = validate(rounds, args.quick, args.only)
    summary = summarise(records, rounds, [load_before, os.getloadavg()[0]], time.perf_counter() - t0)
    for rec in records:
        errs = [s["error"] for s in rec["samples"]]
        print(f"{rec['name']:<62} measured {rec['measured_s'] * 1e3:8.1f} ms  predicted {rec['predicted_s'] * 1e3:8.1f}"
              f" ms  error {rec['error'] * 100:+6.1f}% (rounds {min(errs) * 100:+.0f}..{max(errs) * 100:+.0f}%)")
    print(json.dumps({"steps": summary["steps"], "by_mode": {m: {k: summary["by_mode"][m].get(k) for k in
                     ("runs", "median_abs_error", "p90_abs_error", "spearman")} for m in summary["by_mode"]},
                      "load_average_samples": summary["load_average_samples"], "wall_s": summary["wall_s"]}))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1), encoding="utf-8")
        side = Path(args.json).with_suffix(".summary.json")
        side.write_text(json.dumps({"summary": summary, **extra, "environment": environment()}, indent=1),
                        encoding="utf-8")
    if args.png and records:
        _plot(records, args.png)
    return 0


def _plot(records: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    for mode, marker in (("single", "o"), ("ep", "s"), ("scheduled", "v"), ("pipeline", "D"), ("collective", "^")):
        pts = [(s["measured_s"] * 1e3, r["predicted_s"] * 1e3) for r in records if r["mode"] == mode
               for s in r["samples"]]
        if pts:
            xs, ys = zip(*pts)
            ax.scatter(xs, ys, marker=marker, label=mode, s=12)
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in records) * 1e3 * 0.5
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in records) * 1e3 * 2.0
    line = np.array([lo, hi])
    ax.plot(line, line, "k-", lw=0.8)
    ax.fill_between(line, line * 0.85, line * 1.15, color="grey", alpha=0.2, label="+-15%")
    ax.set(xscale="log", yscale="log", xlabel="measured ms (every round)", ylabel="predicted ms",
           title="simulator vs measured moebal runs (out of sample)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
