"""Where the simulator's expert-parallel step time goes wrong: measured vs simulated phases, on probe shapes only.

    python scripts/diagnose_sim_ep.py [--rounds 5] [--json FILE]

On 2 gloo ranks it interleaves (round-robin, as `validate_simulator.py` does) the calibration probes (fp32
compute probes with both ranks busy, gloo collectives) with expert-parallel training steps of a model built
from probe dimensions (`PROBE_DIMS`: width 336, FFN 720, experts' FFN 176, sequence 176; none of them a
validation workload's shape), static and replicated placements, scheduler mode off. Every step is timed by the
scheduler's event log (`moebal.scheduler.events`): the step, the compute thread's time blocked on
communication, and the time with an all-to-all (counts included), a Trans/Agg or a gradient all-reduce in
flight. The profile is fitted from the probes exactly as the validation fits it; the simulator then replays the
same steps (the measured routing counts) and its `comm_s` per kind and busy time are printed beside the
measured phases. Nothing here is a validation row: this is where constants may be looked for.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from moebal.commands.bench import at_least

_HERE = Path(__file__).resolve().parent


def _vs() -> Any:
    """scripts/validate_simulator.py as a module (its probes, EP step and prediction)."""
    if "validate_simulator" in sys.modules:
        return sys.modules["validate_simulator"]
    spec = importlib.util.spec_from_file_location("validate_simulator", _HERE / "validate_simulator.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["validate_simulator"] = mod
    spec.loader.exec_module(mod)
    return mod


SHAPE = {"model": {"dim": 336, "n_layers": 2, "n_heads": 6, "n_kv_heads": 6, "ffn_dim": 720},
         "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 176}}
"""A probe-shaped MoE model (every weight dimension from PROBE_DIMS or an expert count)."""
def cases(batch: int) -> list[dict[str, Any]]:
    """The EP steps (static and replicated placements) of the probe-shaped model, `batch` sequences of 176."""
    return [{"name": f"diag ep {pl}", "mode": "ep", "shape": "diag", **SHAPE, "batch": batch, "seq": 176,
             "placement": pl} for pl in ("static", "replicated")]


def _ep_step(case: dict[str, Any], rank: int, world: int, out: list[dict[str, float]]) -> tuple[Any, Any]:
    """`validate_simulator.ep_step`'s step with a timer around each phase; appends each step's phases to out."""
    import torch

    from moebal.distributed.expert_parallel import ExpertParallel
    from moebal.distributed.groups import ParallelDims
    from moebal.models import build_model
    from moebal.scheduler import CommScheduler

    vs = _vs()
    cfg = vs._cfg(case)
    torch.manual_seed(0)
    model = build_model(cfg)
    dims = ParallelDims(world_size=world, rank=rank, ep=world).init()
    sched = CommScheduler("off", rank=rank, timeout_s=600)
    ep = ExpertParallel(model, dims, sched)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    placements = vs._placements(case["placement"], cfg.moe.num_experts, world, sum(1 for _ in model.moe_layers()))
    ids = torch.randint(0, 256, (case["batch"], case["seq"] + 1), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        t = [time.perf_counter()]
        sched.log.begin(len(out))
        sched.start_compute()
        ep.apply(placements)
        t.append(time.perf_counter())
        o = model(ids[:, :-1], ids[:, 1:])
        t.append(time.perf_counter())
        (o.loss + o.aux_loss).backward()
        t.append(time.perf_counter())
        ep.aggregate()
        ep.sync_gradients()
        t.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)
        ep.release()
        sched.settle()
        t.append(time.perf_counter())
        comm = sched.log.end()
        out.append({"step_s": t[-1] - t[0], "trans_s": t[1] - t[0], "forward_s": t[2] - t[1],
                    "backward_s": t[3] - t[2], "agg_sync_s": t[4] - t[3], "optimizer_s": t[5] - t[4],
                    "exposed_s": comm.exposed_s, "a2a_s": comm.a2a_s, "placement_s": comm.placement_s,
                    "allreduce_s": comm.allreduce_s,
                    "events": [(e.kind, e.started, e.finished) for e in comm.events]})

    return step, model


def _worker(rank: int, world: int, rounds: int, batch: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from moebal.commands import calibrate as cal

    vs = _vs()
    torch.set_num_threads(1)
    probes = cal.collective_probes(rank, world, vs.PROBE_COLL_BYTES)
    probes.update(vs.compute_probes(False))
    fns = {k: fn for k, (_, fn) in probes.items()}
    phases: dict[str, list[dict[str, float]]] = {}
    models = {}
    runs = cases(batch)
    for case in runs:
        fns[case["name"]], models[case["name"]] = _ep_step(case, rank, world, phases.setdefault(case["name"], []))
    # the same model on one process per rank (both ranks busy, no expert parallelism): its compute alone
    local = {**runs[0], "name": "diag local", "mode": "single"}
    step, _ = vs.model_step(local)
    phases["diag local"] = []

    def local_step(step: Any = step, out: list[dict[str, float]] = phases["diag local"]) -> None:
        t = time.perf_counter()
        step()
        out.append({"step_s": time.perf_counter() - t})
    fns["diag local"] = local_step
    for fn in fns.values():  # warm-up
        fn()
    for v in phases.values():
        v.clear()
    secs, _ = vs.round_robin(fns, rounds, sync=dist.barrier)
    med = {k: statistics.median(v) for k, v in secs.items()}
    coll = [{**meta, "s": med[k]} for k, (meta, _) in probes.items() if k.startswith("coll")]
    counts = {k: vs._layer_counts(m, vs._cfg(next(c for c in runs if c["name"] == k))).tolist()
              for k, m in models.items()}
    return {"compute": cal.compute_records(probes, med), "collective": coll, "phases": phases, "counts": counts}


def _phases(res: list[dict[str, Any]], name: str, rounds: int) -> dict[str, float]:
    """Per phase: the median over rounds of the slower rank's time; for the collectives of an EP step also,
    per kind, the time from the later rank's issue to the last rank's completion (`<kind>_both_s`: the
    transfer once both ranks are in it) and the issue skew between the ranks (`<kind>_skew_s`), summed over the
    step. One clock serves both ranks (CLOCK_MONOTONIC), so their event times compare directly."""
    keys = [k for k in res[0]["phases"][name][0] if k != "events"]
    out = {p: statistics.median(max(r["phases"][name][i][p] for r in res) for i in range(rounds)) for p in keys}
    if "events" not in res[0]["phases"][name][0]:
        return out
    sums: dict[str, list[float]] = {}
    for i in range(rounds):
        per_round: dict[str, float] = {}
        for evs in zip(*(r["phases"][name][i]["events"] for r in res)):
            kind = evs[0][0]
            start = [e[1] for e in evs]
            both, skew = max(e[2] for e in evs) - max(start), max(start) - min(start)
            per_round[f"{kind}_both_s"] = per_round.get(f"{kind}_both_s", 0.0) + both
            per_round[f"{kind}_skew_s"] = per_round.get(f"{kind}_skew_s", 0.0) + skew
        for k, v in per_round.items():
            sums.setdefault(k, []).append(v)
    out.update({k: statistics.median(v) for k, v in sorted(sums.items())})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=at_least(1), default=5)
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--batch", type=at_least(1), default=2, help="sequences of 176 tokens per rank (default 2)")
    ap.add_argument("--no-stats", action="store_true", help="simulate without the balancing statistics' "
                    "all-reduce (SimSpec.stats_allreduce=False), as the simulator did before it was modelled")
    args = ap.parse_args(argv)
    from moebal.distributed.testing import run_ranks
    from moebal.planner.cost import CostModel, ModelShape
    from moebal.planner.hardware_fit import fit_profile
    from moebal.sim.program import Layout, SimSpec
    from moebal.sim.simulate import simulate

    vs = _vs()
    t0 = time.perf_counter()
    res = run_ranks(_worker, 2, args.rounds, args.batch, timeout_s=1800.0)
    runs = cases(args.batch)
    prof = fit_profile({**res[0]["compute"], "collective": res[0]["collective"]}, name="diag-2proc",
                       description="diagnose_sim_ep", source=["scripts/diagnose_sim_ep.py"],
                       calibration={"statistic": "median"})
    cost = CostModel(prof, "fp32")
    out = []
    for case in runs:
        n = case["name"]
        counts = np.stack([np.asarray(r["counts"][n]) for r in res], axis=1)  # [L, R, E]
        cfg = vs._cfg(case)
        spec = SimSpec(layout=Layout(2, ep=2), micro_batch_size=case["batch"], seq_len=case["seq"],
                       dp_overlap=False, bucket_bytes=float("inf"), trans_algorithm="fanout",
                       stats_allreduce=not args.no_stats)
        pls = vs._placements(case["placement"], cfg.moe.num_experts, 2, cfg.model.n_layers)
        sim = simulate(ModelShape.from_config(cfg), cost, spec, counts[:, None], [[p] for p in pls])
        # a phase lasts as long as on its slower rank; medians over the rounds
        meas = _phases(res, n, args.rounds)
        pred = {"step_s": sim.iteration_time_s, "busy_s": float(sim.busy_s.mean()), **sim.comm_s}
        out.append({"name": n, "measured": meas, "simulated": pred})
        print(n)
        print("  measured : " + "  ".join(f"{k} {v * 1e3:7.1f} ms" for k, v in meas.items()))
        print("  simulated: " + "  ".join(f"{k} {v * 1e3:7.1f} ms" for k, v in pred.items()))
    loc = {**runs[0], "mode": "single"}
    sim1 = simulate(ModelShape.from_config(vs._cfg(loc)), cost,
                    SimSpec(layout=Layout(1), micro_batch_size=loc["batch"], seq_len=loc["seq"], count_exchange=False),
                    np.asarray(res[0]["counts"][runs[0]["name"]])[:, None, None, :])
    print(f"diag local (one process per rank, same model)\n  measured : step_s "
          f"{_phases(res, 'diag local', args.rounds)['step_s'] * 1e3:7.1f} ms\n  simulated: step_s "
          f"{sim1.iteration_time_s * 1e3:7.1f} ms")
    print(f"wall {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
