"""Lina's expert packing on a live job (`scheduler.expert_packing: lina`): how many experts each rank holds.

Lina (section 4.3.3 of the thesis) starts with one expert per GPU and doubles the experts per GPU while one
expert computation (FFN micro-op) is shorter than the all-to-all that feeds it: a smaller expert-parallel
group moves fewer rows across the network per exchange (at one expert group per node, none), and every expert
is then held by more data-parallel copies. moebal takes that decision once, at start-up, before the model is
sharded: for the starting layout (`parallel.ep`, or min(ranks, experts)) and every halving of it that still
divides the experts and the ranks, it measures on the job's own devices and links (or reads from the hardware
profile, `planner.costs`) the expert compute of one exchange's rows, the exchange itself and the all-reduce of
a rank's expert gradients among their copies, and applies `moebal.planner.comm_plan.lina_packing` (Lina's rule and
the gradient guard the thesis leaves out). Every rank decides from the slowest rank's figures, so all agree.

Settled here, where the thesis is silent or where moebal differs:
- Once, not "at the 10th step, then every four steps": the inputs (compute of a micro-op, a micro-op on the
  wire) are properties of the layout, the devices and the links, which a start-up measurement sees as well as
  step 10 does, and a live change of the expert-parallel size would reshard every MoE layer and its optimizer
  state mid-run. Packing only ever goes up in the thesis too.
- Replicated experts get their gradient all-reduce (the thesis's gap): that is plain expert x data
  parallelism in moebal (`parallel.ep` < ranks), which the gradient sync and checkpoints already handle.
- No offload: the thesis moves unused experts to host memory when packing runs out of device memory; here
  the packed layout must fit.
- In a pipeline the decision is each stage's (its ranks hold its MoE layers): the candidates halve the stage's
  expert-parallel size, every stage measures its own groups at once, and an exchange carries one rank's share of
  a micro-batch (`exchange_tokens`); the chosen size becomes the run's `parallel.ep` (`pipeline_trainer`).
- The decision and its measurements go to the run's `packing.json`; a resumed run reads it instead of
  measuring again, so it keeps its layout (and its losses, bit for bit).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moebal.config import Config
from moebal.distributed.groups import ParallelDims
from moebal.distributed.probe import probe_link, slowest_over
from moebal.errors import ConfigError
from moebal.fileio import write_text_whole
from moebal.planner.comm_plan import PackingCandidate, lina_packing
from moebal.sync import to_host

if TYPE_CHECKING:
    from moebal.models.moe import SwiGLUExperts

__all__ = ["PACKING_FILE", "candidate_layouts", "choose_expert_parallel"]

PACKING_FILE = "packing.json"


def candidate_layouts(num_experts: int, world: int, ep0: int) -> list[int]:
    """ep0, ep0 / 2, ... while the expert-parallel size still divides the experts and the ranks."""
    out = [ep0]
    while out[-1] % 2 == 0 and num_experts % (out[-1] // 2) == 0 and world % (out[-1] // 2) == 0:
        out.append(out[-1] // 2)
    return out


def exchange_tokens(cfg: Config, ranks: int) -> int:
    """Tokens of one rank in one MoE layer's exchange: its share of the batch without a pipeline, of a micro-batch
    in one (`ranks`: the ranks that split the rows, a pipeline stage's; planned micro-batching's sizes vary, and
    `pipeline.micro_batches` stands for them)."""
    tokens = cfg.data.batch_size * cfg.data.seq_len // ranks
    return max(1, tokens // cfg.pipeline.micro_batches) if cfg.pipelined else tokens


def _profiled(cfg: Config, world: int, eps: list[int], device: torch.device) -> list[PackingCandidate]:
    """The candidates from the hardware profile's cost model (no measurement, the same on every rank); `world`:
    the ranks that hold the experts of a layer (a pipeline stage's); `device`: the one whose precision sets the
    bytes on the wire."""
    from moebal.planner.comm_plan import comm_costs_from_profile
    from moebal.planner.cost import CostModel, ModelShape
    from moebal.train.precision import uses_bf16

    cost = CostModel(cfg.planner.costs, "bf16" if uses_bf16(cfg, device) else "fp32")
    shape = ModelShape.from_config(cfg)
    tokens = exchange_tokens(cfg, world)
    rows = tokens * cfg.moe.top_k
    out = []
    for ep in eps:
        layer = cost.moe_layer_costs(shape, list(range(ep)), tokens, cfg.data.seq_len)
        comm = comm_costs_from_profile(cost, layer, list(range(ep)), list(range(world)))
        out.append(_candidate(ep, world, cfg.moe.num_experts, rows, layer.token_bytes, layer.expert_param_bytes,
                              rows / layer.expert_tokens_per_s, layer.a2a_bw(rows * layer.token_bytes),
                              comm.ar_latency_s, comm.ar_bandwidth))
    return out


def _candidate(ep: int, world: int, E: int, rows: int, token_bytes: float, expert_bytes: float, t_ffn: float,
               a2a_bandwidth: float, ar_latency: float, ar_bandwidth: float) -> PackingCandidate:
    t_a2a = rows * token_bytes * (ep - 1) / ep / a2a_bandwidth if ep > 1 else 0.0
    copies, held = world // ep, E // ep
    t_sync = (ar_latency + 2 * (copies - 1) / copies * held * expert_bytes / ar_bandwidth) if copies > 1 else 0.0
    return PackingCandidate(ep=ep, t_ffn=t_ffn, t_a2a=t_a2a, t_expert_sync=t_sync)


def _measured(cfg: Config, world: int, rank: int, device: torch.device, eps: list[int], pg_timeout_s: float,
              dilate: float, pp: int = 1) -> list[PackingCandidate]:
    """The candidates measured on the job: per layout, a scratch MoE layer sharded over its groups (inside each
    of the `pp` pipeline stages, which all measure at once), timed on the device (synchronised) in the run's
    precision (its autocast; the exchange's rows in that dtype)."""
    from moebal.models.moe import MoELayer
    from moebal.train.precision import autocast_dtype

    E, D = cfg.moe.num_experts, cfg.model.dim
    ranks = world // pp
    tokens = exchange_tokens(cfg, ranks)
    rows = tokens * cfg.moe.top_k
    autocast = autocast_dtype(cfg, device)
    gen = torch.Generator(device=device).manual_seed(2)  # private: the run's RNG streams stay where they are
    with torch.device("meta"):
        scratch = MoELayer.from_config(cfg)
    ex = scratch.to_empty(device=device).experts
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    expert_bytes = sum(p[0].numel() * p.element_size() for p in (ex.w1, ex.w3, ex.w2))
    times = []
    for ep in eps:
        dims = ParallelDims(world_size=world, rank=rank, ep=ep, pp=pp, device=device).init(pg_timeout_s)
        try:
            times += _layout_times(ex, dims, ep, rows, gen, autocast, dilate)
        finally:
            dims.release()  # the candidate's groups: the run builds its own for the layout it picks
    # the all-reduce's latency and bandwidth over the whole job
    link = probe_link(lambda buf: dist.all_reduce(buf), device, agree=slowest_over())
    flat = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)  # every rank decides from the slowest rank's figures
    vals = to_host(flat, "calibration figures")
    token_bytes = D * torch.empty((), dtype=autocast or ex.w1.dtype).element_size()
    out = []
    for k, ep in enumerate(eps):
        t_ffn, t_a2a = vals[2 * k], vals[2 * k + 1]
        bw = rows * token_bytes * (ep - 1) / ep / t_a2a if ep > 1 and t_a2a > 0 else 1.0
        out.append(_candidate(ep, ranks, E, rows, token_bytes, expert_bytes, t_ffn, bw, link.latency_s,
                              link.bandwidth))
    return out


def _layout_times(ex: SwiGLUExperts, dims: ParallelDims, ep: int, rows: int, gen: torch.Generator,
                  autocast: torch.dtype | None, dilate: float) -> list[float]:
    """[expert compute of one exchange's rows, the exchange] on the layout of `ep` ranks per expert group."""
    from moebal.distributed.calibrate import _dilated, median_time
    from moebal.scheduler.exchange import group_plan

    device, D = ex.w1.device, ex.w1.shape[2]
    held = ex.w1.shape[0] // ep
    x = torch.randn(rows, D, device=device, generator=gen)
    plan = group_plan([rows // held + (1 if i < rows % held else 0) for i in range(held)], device)
    w1, w3, w2 = ex.w1[:held], ex.w3[:held], ex.w2[:held]

    def ffn() -> None:
        with torch.no_grad():
            ex.compute(x, w1, w3, w2, plan)

    t_ffn = median_time(_dilated(ffn, dilate), 5, device, autocast)
    if ep == 1:
        return [t_ffn, 0.0]
    send = torch.randn(ep * max(1, rows // ep), D, device=device, generator=gen).to(autocast or ex.w1.dtype)
    recv, group = torch.empty_like(send), dims.group("ep")
    return [t_ffn, median_time(lambda: dist.all_to_all_single(recv, send, group=group), 5, device)]


def choose_expert_parallel(cfg: Config, world: int, rank: int, device: torch.device, ep0: int,
                           run_dir: Path | None = None, resume: bool = False) -> int:
    """The expert-parallel size of the run under `scheduler.expert_packing` (ep0 when off): of the trainer's
    ranks, or in a pipeline (`parallel.pp` stages, or a dynamism scheme's one stage) of each stage's, which hold
    its MoE layers. Collective on every rank when it measures. Writes (rank 0) or, on resume, reads the run
    directory's packing.json."""
    sc = cfg.scheduler
    pp = cfg.parallel.pp if cfg.pipelined else 1
    if sc.expert_packing == "off" or not cfg.moe.num_experts or world // pp == 1:
        return ep0
    path = run_dir / PACKING_FILE if run_dir is not None else None
    if resume and path is not None and path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            ep = int(saved["ep"])
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path} is damaged ({e}): delete it to measure the packing again, or resume "
                              f"with parallel.ep set to the run's expert-parallel size") from None
        return ep
    eps = candidate_layouts(cfg.moe.num_experts, world // pp, ep0)
    if cfg.planner.costs == "measure":
        cands = _measured(cfg, world, rank, device, eps, 60.0 * cfg.parallel.timeout_min, sc.dilate, pp)
    else:
        cands = _profiled(cfg, world // pp, eps, device)
    ep, why = lina_packing(cands)
    record: dict[str, Any] = {"ep": ep, "start_ep": ep0, "experts_per_rank": cfg.moe.num_experts // ep,
                              "source": cfg.planner.costs, "decisions": why,
                              "candidates": [vars(c) for c in cands]}
    if rank == 0:
        import sys

        sys.stderr.write(f"moebal: expert packing (Lina): ep {ep0} -> {ep} "
                         f"({cfg.moe.num_experts // ep} experts per rank); {'; '.join(why)}\n")
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_whole(path, json.dumps(record, indent=1) + "\n")
    return ep
