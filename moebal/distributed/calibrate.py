"""Measure the planner's performance-model coefficients on the running job (a second, at start-up).

The Pro-Prophet planner needs, for one MoE layer: expert throughput (tokens/s), all-to-all bandwidth and
the bandwidth of the parameter transfer (Trans) and gradient return (Agg). A hardware profile gives them for
modelled clusters; a live job measures them on its own devices and links with the very operations it runs.
Every rank measures, then the group agrees on the slowest figure (an all-reduce of the times), so every rank
plans from identical numbers and computes identical placements.

Every figure comes from the shared timing helper (`moebal.kernels.bench.time_fn`): on CUDA each timed call is
bracketed by a device synchronisation (a kernel launch returns long before the kernel ends), and the expert
computation runs under the run's autocast (the dispatcher's `compute_dtype`: bf16 for a bf16 run), with the
all-to-all payload in that dtype, as in training (an fp32 timing of a bf16 run would understate a GPU's expert
throughput several-fold), and Trans is timed with the payload it sends (`expert_flat`, in the same dtype).

The figures vary from one measurement to the next (tens of per cent on a shared machine), and placements
follow them, so a run measures once: the trainer's expert-parallel hook keeps the figures in every
checkpoint and a resumed run plans from the saved ones (see `ExpertParallelHook`). The measurement draws
its inputs from a private generator, so it never moves the run's RNG streams.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from moebal.distributed.dilate import settle
from moebal.distributed.expert_parallel import ExpertParallelDispatcher
from moebal.distributed.probe import probe_link, slowest_over
from moebal.kernels.bench import time_fn
from moebal.planner.comm_plan import CommCosts
from moebal.planner.perf import MoELayerCosts
from moebal.scheduler.exchange import group_plan
from moebal.sync import to_host

__all__ = ["costs_from_dict", "costs_to_dict", "describe", "measure_comm_costs", "measure_layer_costs",
           "median_time"]


def median_time(fn: Callable[[], Any], repeats: int, device: torch.device,
                autocast: torch.dtype | None = None) -> float:
    """Median seconds of `fn()` after one warm-up call: the shared timing helper, synchronising `device`
    around each call, under `autocast` when given."""
    return time_fn(fn, warmup=1, repeats=repeats, device=device, autocast=autocast).median


def _dilated(fn: Callable[[], None], dilate: float) -> Callable[[], None]:
    """`fn` on a device `dilate` x slower than this core (`moebal.distributed.dilate`; 1: `fn` itself)."""
    if dilate <= 1.0:
        return fn

    def slow() -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        settle(dilate, time.thread_time() - c0, t0)

    return slow


@contextmanager
def _weights_whole(d: ExpertParallelDispatcher) -> Iterator[None]:
    """The layer's expert weights whole inside: gathered when they are sharded at rest (`parallel.shard: full`;
    collective over "dp": every rank measures at start-up), freed after."""
    if d.weights is None:
        yield
        return
    d.weights.gather()
    try:
        yield
    finally:
        d.weights.release()


def measure_layer_costs(d: ExpertParallelDispatcher, tokens: int, repeats: int = 5,
                        dilate: float = 1.0) -> MoELayerCosts:
    """Coefficients for `d`'s layer when each rank routes about `tokens` token-expert assignments per step
    (`dilate` > 1: on an emulated device that many times slower than a core, as the scheduler's), the experts
    computing under autocast to `d.compute_dtype` (the run's precision; None: the parameters' dtype)."""
    with _weights_whole(d):
        return _measure_layer(d, tokens, repeats, dilate)


def _measure_layer(d: ExpertParallelDispatcher, tokens: int, repeats: int, dilate: float) -> MoELayerCosts:
    ex = d.layer.experts
    dev, dtype, autocast = ex.w1.device, ex.w1.dtype, d.compute_dtype
    D = ex.w1.shape[2]
    rows = max(64, tokens)
    local = len(d.owned)
    gen = torch.Generator(device=dev).manual_seed(0)  # private: the run's RNG streams stay where they are
    x = torch.randn(rows, D, device=dev, dtype=dtype, generator=gen)
    counts = [rows // local + (1 if i < rows % local else 0) for i in range(local)]
    plan = group_plan(counts, dev)

    @partial(_dilated, dilate=dilate)
    def expert_fwd() -> None:
        with torch.no_grad():
            ex.compute(x, ex.w1, ex.w3, ex.w2, plan)

    R, group = d.R, d.group
    # rows travel in the compute dtype (autocast's), as the layer sends them
    chunk = torch.randn(R * max(1, rows // R), D, device=dev, dtype=dtype, generator=gen).to(autocast or dtype)
    out = torch.empty_like(chunk)

    def a2a() -> None:
        dist.all_to_all_single(out, chunk, group=group)

    flat = d.expert_flat(d.owned[0])
    recv = torch.empty_like(flat)
    nxt, prv = d.ep_ranks[(d.r + 1) % R], d.ep_ranks[(d.r - 1) % R]

    def ring() -> None:
        ops = [dist.P2POp(dist.isend, flat, nxt), dist.P2POp(dist.irecv, recv, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    times = torch.tensor([median_time(expert_fwd, repeats, dev, autocast), median_time(a2a, repeats, dev),
                          median_time(ring, repeats, dev)], dtype=torch.float64, device=dev)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)  # every rank plans from the same numbers
    t_exp, t_a2a, t_ring = to_host(times, "calibration figures")
    elem, w_elem = chunk.element_size(), flat.element_size()
    a2a_bytes = chunk.numel() * elem * (R - 1) / R
    return MoELayerCosts(token_bytes=D * elem, expert_param_bytes=flat.numel() * w_elem,
                         expert_grad_bytes=flat.numel() * w_elem, expert_tokens_per_s=rows / t_exp,
                         a2a_bandwidth=a2a_bytes / t_a2a, trans_bandwidth=flat.numel() * w_elem / t_ring,
                         agg_bandwidth=flat.numel() * w_elem / t_ring, num_ranks=R)


def costs_to_dict(costs: MoELayerCosts) -> dict[str, Any]:
    """Measured coefficients as JSON data (constant bandwidths only: what `measure_layer_costs` returns)."""
    d = dataclasses.asdict(costs)
    if not all(isinstance(v, (int, float)) or v is None for v in d.values()):
        raise ValueError("only measured costs (constant bandwidths) serialise; a profile's costs are rebuilt "
                         "from the config instead")
    return d


def costs_from_dict(d: dict[str, Any]) -> MoELayerCosts:
    return MoELayerCosts(**d)


def describe(costs: MoELayerCosts) -> dict[str, Any]:
    """The measured figures in readable units (for logs and benchmark records)."""
    return {"expert_tokens_per_s": round(costs.expert_tokens_per_s, 1),
            "a2a_GBps": round(costs.a2a_bw(0) / 1e9, 3), "trans_GBps": round(costs.trans_bandwidth / 1e9, 3),
            "expert_param_MB": round(costs.expert_param_bytes / 1e6, 3)}


def measure_comm_costs(d: ExpertParallelDispatcher, dense_group: Any, tokens: int, layer: MoELayerCosts,
                       repeats: int = 5, dilate: float = 1.0) -> CommCosts:
    """The communication model's coefficients on the running job (collective over every rank):

    - gradient all-reduce latency and bandwidth: the link probe (`moebal.distributed.probe`) on all-reduces of
      16 KiB and 4 MiB over the stage's ranks (alpha + S / beta);
    - all-to-all latency: an all-to-all of 8 bytes per rank;
    - overlap: an all-to-all of one step's size and an expert computation sized to take about as long, alone
      and together (all-to-all in flight while the experts compute): (t_compute + t_a2a - t_both) /
      min(t_compute, t_a2a), clipped to [0, 1]. Equal durations keep the figure above the timing noise. On a
      GPU it is close to 1; on a CPU the cores that compute also move the bytes.
    Every rank of the job adopts the slowest rank's figures (an all-reduce of the times over the default group),
    so all plan alike. With `dilate` > 1 the expert computation runs on the emulated device
    (`moebal.distributed.dilate`); it runs under autocast to `d.compute_dtype` (the run's precision), and the
    all-to-all payload is in that dtype.
    """
    with _weights_whole(d):
        return _measure_comm(d, dense_group, tokens, layer, repeats, dilate)


def _measure_comm(d: ExpertParallelDispatcher, dense_group: Any, tokens: int, layer: MoELayerCosts,
                  repeats: int, dilate: float) -> CommCosts:
    ex = d.layer.experts
    dev, dtype, autocast = ex.w1.device, ex.w1.dtype, d.compute_dtype
    D = ex.w1.shape[2]
    R, group = d.R, d.group
    tiny_in, tiny_out = torch.zeros(R * 2, device=dev), torch.zeros(R * 2, device=dev)
    rows = max(64, tokens)
    gen = torch.Generator(device=dev).manual_seed(1)  # private: the run's RNG streams stay where they are
    chunk = torch.randn(R * max(1, rows // R), D, device=dev, dtype=dtype, generator=gen).to(autocast or dtype)
    out = torch.empty_like(chunk)

    def a2a() -> None:
        dist.all_to_all_single(out, chunk, group=group)

    link = probe_link(lambda buf: dist.all_reduce(buf, group=dense_group), dev, repeats=repeats,
                      agree=slowest_over())
    times = torch.tensor([median_time(f, repeats, dev) for f in (
        lambda: dist.all_to_all_single(tiny_out, tiny_in, group=group), a2a)], dtype=torch.float64, device=dev)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    t_tiny, t_a = to_host(times, "calibration figures")
    # expert compute sized to last about as long as the all-to-all (same rows on every rank)
    n = int(min(max(16, t_a * layer.expert_tokens_per_s), 8 * rows))
    local = len(d.owned)
    x = torch.randn(n, D, device=dev, dtype=dtype, generator=gen)
    plan = group_plan([n // local + (1 if i < n % local else 0) for i in range(local)], dev)

    @partial(_dilated, dilate=dilate)
    def compute() -> None:
        with torch.no_grad():
            ex.compute(x, ex.w1, ex.w3, ex.w2, plan)

    def both() -> None:
        work = dist.all_to_all_single(out, chunk, group=group, async_op=True)
        compute()
        work.wait()

    # the layer's rates were agreed inside the expert-parallel group only; the gradient chunks depend on them
    # too, and every rank of a stage must cut alike: agree on the slowest over the whole job
    t2 = torch.tensor([median_time(f, repeats, dev, autocast) for f in (compute, a2a, both)]
                      + [1.0 / layer.a2a_bw(0), 1.0 / layer.expert_tokens_per_s], dtype=torch.float64, device=dev)
    dist.all_reduce(t2, op=dist.ReduceOp.MAX)
    t_c, t_a, t_b, inv_a2a_bw, inv_tok = to_host(t2, "calibration figures")
    overlap = min(1.0, max(0.0, (t_c + t_a - t_b) / max(min(t_c, t_a), 1e-9)))
    return CommCosts(ar_latency_s=link.latency_s, ar_bandwidth=link.bandwidth, a2a_latency_s=t_tiny,
                     a2a_bandwidth=1.0 / inv_a2a_bw,
                     expert_tokens_per_s=1.0 / inv_tok, backward_factor=layer.backward_factor, overlap=overlap)
