"""The expert planner's closed forms against the simulator, on hand-made routing (docs/cost-model.md, "Where the
expert planner's closed forms and the simulator disagree"). Pure functions only: no model, no process group.

1. One all-to-all, uniform and skewed (every rank's tokens to expert 0), per hardware profile: the planner's
   time (`evaluate`, from the uniform exchange's bandwidth) and the simulator's (the byte matrix over the links).
2. Pro-Prophet's greedy replication sequence (prefix n: the first n experts replicated) on Zipf routing: each
   prefix's time by the planner's model (`evaluate_held`) and by the simulator, and whether the planner's choice
   is the simulator's fastest.

    python scripts/planner_against_simulator.py [--profiles a100,h100,rtx3090] [--ranks 8]
        [--zipf 0.5,1.0,2.0] [--seed 0] [--trans fanout|chain] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from moebal.commands.bench import at_least
from moebal.fileio import write_text_whole
from moebal.planner.cost import CostModel, ModelShape
from moebal.planner.perf import evaluate, evaluate_held, held_loads, replicas_from_held
from moebal.planner.placement import _receivers
from moebal.planner.plan import ExpertPlacement
from moebal.sim.program import Layout, SimSpec, _split_placement
from moebal.sim.simulate import simulate

TOKENS = 4096


def shape_for(experts: int) -> ModelShape:
    return ModelShape(dim=1024, n_layers=1, n_heads=8, n_kv_heads=8, head_dim=128, ffn_dim=4096, vocab_size=1000,
                      num_experts=experts, top_k=2, expert_ffn_dim=2048)


def all_to_all(profile: str, R: int) -> dict[str, float]:
    """One dispatch all-to-all of R ranks (one expert each), uniform and skewed: planner and simulator, ms."""
    cost, shape = CostModel(profile, "bf16"), shape_for(R)
    costs = cost.moe_layer_costs(shape, list(range(R)), TOKENS, TOKENS, num_ranks=R)
    topo, pl = cost.topology(R), ExpertPlacement.static(R, R)
    out: dict[str, float] = {}
    for name, c_RE in (("uniform", np.full((R, R), TOKENS / R)), ("skewed", _to_expert_0(R))):
        _, remote, _ = _split_placement(c_RE, pl)
        send = np.zeros((R, R))
        for e in range(R):
            send[:, pl.owner[e]] += remote[:, e]
        np.fill_diagonal(send, 0)
        sim = cost.time_of(cost.all_to_all(topo, range(R), send * shape.dim * cost.act_bytes), topo)
        out[f"{name}_planner_ms"] = 1e3 * evaluate(c_RE, pl, costs).a2a_s
        out[f"{name}_simulator_ms"] = 1e3 * sim
    return out


def _to_expert_0(R: int) -> np.ndarray:
    c_RE = np.zeros((R, R))
    c_RE[:, 0] = TOKENS
    return c_RE


def prefixes(profile: str, R: int, zipf: float, seed: int, trans: str = "fanout") -> dict[str, object]:
    """Each prefix of the greedy replication sequence: (planner ms, simulator ms), and the two choices; Trans and
    Agg sent by `trans` in both."""
    cost, shape = CostModel(profile, "bf16"), shape_for(R)
    costs = cost.moe_layer_costs(shape, list(range(R)), TOKENS, TOKENS, num_ranks=R, trans_algorithm=trans)
    spec = SimSpec(layout=Layout(R, 1, R), seq_len=TOKENS, trans_overlap=False, optimizer=False, grad_bytes=2,
                   trans_algorithm=trans, count_exchange=False, dp_overlap=False)
    rng = np.random.default_rng(seed)
    owner = np.arange(R)
    pop = 1 / np.arange(1, R + 1) ** zipf
    pop = rng.permutation(pop / pop.sum())
    c_RE = np.stack([rng.multinomial(TOKENS * 2, pop) for _ in range(R)]).astype(float)
    inc = _receivers(c_RE, owner, 0, True)
    held = np.zeros((R, R), bool)
    held[owner, np.arange(R)] = True
    seq, used = [held.copy()], set()
    while True:  # Pro-Prophet's order: the busiest rank's expert that moves the most tokens
        busiest = int(held_loads(c_RE, held, owner)[0].argmax())
        cand = [e for e in range(R) if owner[e] == busiest and e not in used and inc[:, e].any()]
        if not cand:
            break
        e = max(cand, key=lambda e: ((c_RE[:, e] * inc[:, e]).sum(), -e))
        used.add(e)
        held[:, e] |= inc[:, e]
        seq.append(held.copy())
    rows = []
    for h in seq:
        pl = ExpertPlacement(num_ranks=R, owner=tuple(owner.tolist()), replicas=replicas_from_held(h, owner))
        rows.append((1e3 * evaluate_held(c_RE, h, owner, costs, False).total_s,
                     1e3 * simulate(shape, cost, spec, c_RE[None, None], [[pl]]).iteration_time_s))
    planner = min(range(len(rows)), key=lambda k: (rows[k][0], k))
    fastest = min(range(len(rows)), key=lambda k: (rows[k][1], k))
    return {"zipf": zipf, "prefix_ms": [[round(p, 4), round(s, 4)] for p, s in rows], "planner_choice": planner,
            "simulator_fastest": fastest, "inverted": planner != fastest}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default="a100,h100,rtx3090")
    ap.add_argument("--ranks", type=at_least(2), default=8)
    ap.add_argument("--zipf", default="0.5,1.0,2.0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trans", choices=("fanout", "chain"), default="fanout",
                    help="how Trans/Agg go, in the planner and the simulator alike (default: moebal's fan-out)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        zipfs = [float(z) for z in args.zipf.split(",")]
    except ValueError:
        ap.error(f"--zipf takes comma-separated numbers; got {args.zipf!r}")
    report = {p: {"all_to_all": all_to_all(p, args.ranks),
                  "prefixes": [prefixes(p, args.ranks, z, args.seed, args.trans) for z in zipfs]}
              for p in args.profiles.split(",")}
    for p, r in report.items():
        a = r["all_to_all"]
        print(f"{p}: all-to-all uniform planner {a['uniform_planner_ms']:.3f} / simulator "
              f"{a['uniform_simulator_ms']:.3f} ms; skewed {a['skewed_planner_ms']:.3f} / "
              f"{a['skewed_simulator_ms']:.3f} ms")
        for z in r["prefixes"]:
            print(f"  zipf {z['zipf']}: planner picks prefix {z['planner_choice']}, simulator's fastest "
                  f"{z['simulator_fastest']}{' (inverted)' if z['inverted'] else ''}; [planner, simulator] ms "
                  f"{z['prefix_ms']}")
    if args.json:
        write_text_whole(args.json, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
