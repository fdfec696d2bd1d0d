"""Measure a micro-batch cost table on this machine: every stage's forward and backward of real micro-batches.

Shape legend: B = rows, T = padded length, D = model dim, V = vocabulary.

For each grid shape (b, s) (`mbcost.default_grid`: powers of two, b x s within a token cap) the stage's
layers run a forward and a backward on random inputs of that shape, as the engine runs them (the first
stage embeds token ids, the last computes the loss; middle stages take a (b, s, D) activation and send one
back), under the run's precision. Times are the median of `repeats` after one warm-up, in the clock the
pipeline profiler uses (a CPU rank's thread CPU time: on a machine with fewer cores than ranks wall time
measures the scheduler; CUDA: wall time after a synchronise). Memory is what autograd saves for the
backward (saved-tensor hooks, parameters excluded), the same count as `observe.py`. Under expert parallelism
(or routing losses summed over a stage) every rank of a stage profiles the same grid in the same order, so the
MoE layers' all-to-alls and all-reduces pair up; the routing statistics of the profile are dropped.

A table measured on one rank per stage is gathered along the pipeline (`profile_stage` per rank, then
`gather`); `profile_table` measures every stage in one process (the CLI, benchmarks, tests).
"""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from moebal.config import Config
from moebal.pipeline.observe import pick_clock
from moebal.pipeline.stage import PipelineStage
from moebal.planner.microbatch_cost import MicroBatchCost, default_grid
from moebal.train.precision import compute_precision, uses_bf16

__all__ = ["profile_stage", "profile_table", "stage_sizes"]


def stage_sizes(n_layers: int, stages: int) -> list[int]:
    """Uniform layer counts per stage (the partition the pipeline starts from)."""
    return [len(x) for x in np.array_split(np.arange(n_layers), stages)]


def _autocast(cfg: Config, device: torch.device) -> Callable[[], Any]:
    if uses_bf16(cfg, device):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext


def _one(stage: PipelineStage, b: int, s: int, autocast: Callable[[], Any], clock: Callable[[], float],
         device: torch.device) -> tuple[float, float, float]:
    """(forward s, backward s, saved bytes) of one micro-batch of b x s through the stage."""
    m = stage.cfg.model
    gen = torch.Generator(device="cpu").manual_seed(b * 100003 + s)
    ids = torch.randint(0, m.vocab_size, (b, s), generator=gen).to(device)
    params = {p.data_ptr() for p in stage.parameters()}
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            saved[0] += t.numel() * t.element_size()
        return t

    dtype = next(stage.parameters()).dtype
    h_in = None if stage.first else torch.randn(b, s, m.dim, generator=gen, dtype=dtype).to(device).requires_grad_()
    t0 = clock()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        h = stage.embed(ids) if h_in is None else h_in  # h_in is None exactly on the first stage
        cos, sin = stage.rope(s, h.dtype)
        for i in stage.layer_ids:
            h = stage.layer(i)(h, cos, sin)
        out = stage.head_loss_sum(h, ids) / (b * s) if stage.last else h
    t1 = clock()
    if stage.last:
        out.backward()
    else:
        out.backward(torch.ones_like(out))
    t2 = clock()
    stage.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, float(saved[0])


def profile_stage(stage: PipelineStage, b_grid: np.ndarray, s_grid: np.ndarray, max_tokens: int,
                  repeats: int = 3, device: torch.device | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[NB, NS] forward seconds, backward seconds and saved bytes of one stage (NaN beyond the token cap)."""
    device = device or torch.device("cpu")
    clock = pick_clock(device)
    autocast = _autocast(stage.cfg, device)
    shape = (len(b_grid), len(s_grid))
    fwd, bwd, act = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    for js, s in enumerate(s_grid.tolist()):
        for ib, b in enumerate(b_grid.tolist()):
            if b * s > max_tokens:
                continue
            _one(stage, b, s, autocast, clock, device)  # warm-up (allocator, kernels' first call)
            runs = [_one(stage, b, s, autocast, clock, device) for _ in range(repeats)]
            fwd[ib, js] = statistics.median(r[0] for r in runs)
            bwd[ib, js] = statistics.median(r[1] for r in runs)
            act[ib, js] = runs[0][2]
    for i in stage.layer_ids:  # the profile's routing is no step's: the expert balancer must not observe it
        if stage.layer(i).is_moe:
            stage.layer(i).block_sparse_moe.take_stats()
    return fwd, bwd, act


def profile_table(cfg: Config, stages: int, *, max_len: int, max_tokens: int, repeats: int = 3,
                  sizes: list[int] | None = None, device: torch.device | None = None) -> MicroBatchCost:
    """Every stage of cfg's model (uniform stages unless `sizes`), measured one after the other here."""
    from moebal.models import build_model
    from moebal.train.trainer import seed_everything

    sizes = sizes or stage_sizes(cfg.model.n_layers, stages)
    b_grid, s_grid = default_grid(max_len, max_tokens)
    seed_everything(cfg.train.seed)
    model = build_model(cfg)
    device = device or torch.device("cpu")
    fwd, bwd, act = [], [], []
    edges = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    for p in range(len(sizes)):
        stage = PipelineStage.from_model(model, edges[p], edges[p + 1], p == 0, p == len(sizes) - 1).to(device)
        f, b, a = profile_stage(stage, b_grid, s_grid, max_tokens, repeats, device)
        fwd.append(f)
        bwd.append(b)
        act.append(a)
    precision = compute_precision(cfg.train.precision, device)
    return MicroBatchCost(b_grid=b_grid, s_grid=s_grid, fwd_PBS=np.stack(fwd), bwd_PBS=np.stack(bwd),
                          act_PBS=np.stack(act), source=f"measured:{platform.node() or 'host'}:{precision}",
                          meta={"sizes": sizes, "threads": torch.get_num_threads(), "max_tokens": max_tokens,
                                "model": {"dim": cfg.model.dim, "n_layers": cfg.model.n_layers}})
