"""Text generation with expert parallelism on N local gloo ranks: `moebal generate SOURCE --nproc N --policy P`.

Each rank decodes its share of the prompts with the KV-cached decoder (moebal/models/generate.py), and every MoE
layer's tokens go to their experts' ranks through Lina's inference scheduling (moebal/distributed/lina_inference.py,
the dispatcher `moebal eval` uses): plain expert parallelism ("static": a contiguous block of experts per rank) or
a mapping with replicas of the popular experts, planned from the tokens' paths before the gate ("lina",
"phase1") or from the real counts ("oracle"). Every rank holds every expert's weights (Lina's host-DRAM copy), so
a mapping moves no weights.

Prompts: a global batch of `batch_size` prompts is cut into contiguous shares, rank r taking the r-th, each share
as long as the longest (ceil(batch / N)): a rank with fewer prompts fills its share with a one-token dummy prompt
whose tokens are dropped. Every rank then runs the same forwards (`generate_many`'s `Lockstep`): a rank whose rows
have all stopped goes on with them until every rank's have (one all-reduce of a flag per new token), since each
MoE layer's exchanges need every rank. A row's positions, masks and sampling generator are its own
(`generate_many`), and every policy gives the static run's logits bit for bit: a layer of at least `min_rows`
assignments over every rank computes the experts' rows in groups padded to `MIN_ROWS`, so a row's logits do not
depend on its rank or its neighbours either; one of fewer (a decode step of a few sequences) runs the same static
blocks under every policy, unpadded, its bits then depending on its groups' sizes as one process's do (the module
`lina_inference`'s MIN_ROWS and `LinaDispatcher._unsplittable`). The tests compare the tokens with the
single-process decoder's as well.

Forward only, on CPU gloo ranks (a NCCL run would put each rank's model on its own device and exchange device
tensors; the dispatcher already does, the flag's all-reduce below would too, but `run_ranks` starts gloo ranks).
"""

from __future__ import annotations

import dataclasses
import io
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moebal.distributed.lina_inference import MIN_ROWS, LinaInference, slowest_rank_parts
from moebal.models.generate import Generation, Sampling, check_prompts, generate_many

__all__ = ["GenerateJob", "PolicyResult", "check_expert_parallel", "expert_parallel_generate", "generate_worker",
           "share"]

DUMMY_PROMPT = [0]  # fills a rank's share; its tokens are dropped


@dataclass
class GenerateJob:
    """What every rank of an expert-parallel generation needs (pickled to the ranks)."""

    model: Any
    prompts: list[list[int]]
    batch_size: int
    max_new_tokens: int
    sampling: Sampling
    stop_ids: list[int]
    cache: bool
    policies: list[str]  # in the order they run
    profile: Any = None
    threads: int = 1
    min_rows: int = MIN_ROWS  # `LinaInference`'s: a holder's least share of an expert's rows
    warmup: bool = False
    """Run the first batch once under the first policy before the policies, untimed and dropped: the ranks' first
    forwards (allocations, first calls) then weigh on no policy's timings (benchmarks)."""
    seeds: list[int] | None = None
    """Each prompt's sampling seed (`generate_many`'s; None: `sampling.seed` for every one)."""


@dataclass
class PolicyResult:
    """One policy's generation over every prompt."""

    generations: list[Generation]
    """In the prompts' order."""
    parts: list[dict[str, float]] = field(default_factory=list)
    """Per forward: the MoE layers' time, each layer the slowest rank's, summed over the layers (`seconds`), and
    that rank's experts, planning and exchanges in it (`experts_s`, `plan_s`, `exchange_s`):
    `slowest_rank_parts`."""
    replans: int = 0
    """Layers phase 2 re-planned (rank 0's count: every rank plans the same)."""
    replicas: int = 0
    """Expert replicas over every layer and forward (rank 0's mappings)."""
    rows: list[int] = field(default_factory=list)
    """Per forward, the rows the first MoE layer computed over every rank (tokens x k): a prompt's forward has
    its prompt's tokens, a decode step one a row."""

    @property
    def moe_s(self) -> list[float]:
        """Per forward: the MoE layers' time, each layer the slowest rank's, summed over the layers."""
        return [p["seconds"] for p in self.parts]

    @property
    def moe_s_median(self) -> float:
        return statistics.median(self.moe_s) if self.moe_s else 0.0


def share(n: int, world: int, rank: int) -> tuple[list[int], int]:
    """(the indices rank `rank` takes of a global batch of `n` prompts, the share's length every rank pads to)."""
    per = -(-n // world)
    return list(range(min(rank * per, n), min((rank + 1) * per, n))), per


class _Lockstep:
    """`Lockstep` over the world group; keeps each forward's MoE layer records (the scheduler's `begin` clears
    them)."""

    def __init__(self, sched: LinaInference) -> None:
        self.sched = sched
        self.forwards: list[list[dict[str, Any]]] = []

    def before_forward(self) -> None:
        self.flush()
        self.sched.begin()

    def flush(self) -> None:
        if self.sched.records:
            self.forwards.append([dataclasses.asdict(r) for r in self.sched.records])
            self.sched.records = []

    def all_done(self, done_here: bool) -> bool:
        going = torch.tensor([0 if done_here else 1], dtype=torch.int32)
        dist.all_reduce(going)
        return int(going.item()) == 0


def generate_worker(rank: int, world: int, packed: bytes) -> dict[str, Any]:
    """Every policy's generation of this rank's shares (module docstring): per policy, (global index,
    generation) of its real prompts and its forwards' MoE layer records."""
    job: GenerateJob = torch.load(io.BytesIO(packed), weights_only=False)
    torch.set_num_threads(job.threads)
    model = job.model.eval()

    def run(policy: str, batches: int) -> dict[str, Any]:
        sched = LinaInference(model, dist.group.WORLD, policy, job.profile if policy in ("lina", "phase1") else None,
                              min_rows=job.min_rows)
        lock = _Lockstep(sched)
        mine: list[tuple[int, Generation]] = []
        for start in range(0, len(job.prompts), job.batch_size)[:batches]:
            n = min(job.batch_size, len(job.prompts) - start)
            idx, per = share(n, world, rank)
            prompts = [job.prompts[start + i] for i in idx] + [DUMMY_PROMPT] * (per - len(idx))
            seeds = None if job.seeds is None else \
                [job.seeds[start + i] for i in idx] + [job.sampling.seed] * (per - len(idx))
            gens = generate_many(model, prompts, job.max_new_tokens, job.sampling, cache=job.cache,
                                 stop_ids=job.stop_ids, lockstep=lock, seeds=seeds)
            mine += [(start + i, g) for i, g in zip(idx, gens)]
        lock.flush()
        return {"generations": mine, "forwards": lock.forwards}

    if job.warmup:
        run(job.policies[0], 1)
    return {policy: run(policy, len(job.prompts)) for policy in job.policies}


def check_expert_parallel(model: Any, nproc: int, instead: str) -> None:
    """Refuse, before any rank starts, a model that `nproc` expert-parallel ranks cannot serve; `instead`: what
    to do with a model without MoE layers."""
    layers = list(model.moe_layers())
    if not layers:
        raise ValueError(f"the model has no MoE layer: expert parallelism has nothing to spread ({instead})")
    if layers[0].num_experts % nproc:
        raise ValueError(f"{layers[0].num_experts} experts cannot be spread evenly over {nproc} ranks: choose a "
                         f"number of ranks that divides them")


def expert_parallel_generate(model: Any, prompts: list[list[int]], nproc: int, max_new_tokens: int,
                             sampling: Sampling | None = None, *, batch_size: int = 8,
                             stop_ids: list[int] | None = None, cache: bool = True, policies: list[str] | None = None,
                             profile: Any = None, timeout_s: float = 1800.0,
                             min_rows: int = MIN_ROWS, warmup: bool = False,
                             seeds: list[int] | None = None) -> dict[str, PolicyResult]:
    """Each policy's generations of `prompts` on `nproc` gloo ranks (module docstring), policies in the order
    given (default: static); `min_rows`: `LinaInference`'s (0: the thesis's allocation); `warmup`, `seeds`:
    `GenerateJob`'s."""
    from moebal.distributed.testing import run_ranks

    if nproc < 1 or batch_size < 1:
        raise ValueError(f"nproc and batch_size must be >= 1; got {nproc}, {batch_size}")
    check_prompts(model, prompts, max_new_tokens, cache)
    check_expert_parallel(model, nproc, "generate on one process")
    job = GenerateJob(model, [list(p) for p in prompts], batch_size, max_new_tokens, sampling or Sampling(),
                      list(stop_ids or []),
                      cache, list(policies or ["static"]), profile, min_rows=min_rows, warmup=warmup,
                      seeds=None if seeds is None else list(seeds))
    buf = io.BytesIO()
    torch.save(job, buf)
    results = run_ranks(generate_worker, nproc, buf.getvalue(), timeout_s=timeout_s)
    report: dict[str, PolicyResult] = {}
    for policy in job.policies:
        per_rank = [r[policy] for r in results]
        gens = dict(g for r in per_rank for g in r["generations"])
        forwards = [r["forwards"] for r in per_rank]
        first = forwards[0]
        report[policy] = PolicyResult([gens[i] for i in range(len(prompts))], slowest_rank_parts(forwards),
                                      sum(x["replanned"] for f in first for x in f),
                                      sum(x["replicas"] for f in first for x in f),
                                      [sum(f[0]["rank_rows"]) for f in first])
    return report
