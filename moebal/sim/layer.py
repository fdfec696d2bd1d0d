"""One MoE layer, forward and backward, simulated from Pro-Prophet's coefficients (`perf.MoELayerCosts`).

A cross-check of the performance model: the engine replays the layer as ops and flows (Trans, dispatch all-to-all,
forward expert compute, combine all-to-all, then the backward's two all-to-alls around the backward expert compute,
then Agg) on a topology whose every rank has its own link of the A2A bandwidth, so the all-to-all takes max over
links of bytes / bandwidth, eq. 1's max_i R_i * size / B when the receivers are the busiest links. Without overlap
it reproduces eq. 6 exactly for placements whose replicas all go to every rank (n = 0) where both of eq. 6's
simplifications hold: the receivers are the busiest links (a rank sending more tokens than any rank receives loads
its own link beyond eq. 1: 3 ranks, counts [[0, 1, 1], 0, 0], 11 against eq. 6's 7), and the replicas' chains share
a link (at R = 2 with both experts replicated, the chains 0 -> 1 and 1 -> 0 run on separate links, where eq. 4/5
charge two transfer times each); with `overlap`, Trans runs beside a non-MoE forward of nonmoe_fwd_s before the
layer and Agg beside a non-MoE backward of nonmoe_bwd_s after it, the one-block version of the
scheduler behind eq. 8.

Shape legend: R = ranks, E = experts.
"""

from __future__ import annotations

import numpy as np

from moebal.planner.cost import CostModel
from moebal.planner.hardware import GemmSpec, HardwareProfile, LinkSpec
from moebal.planner.perf import MoELayerCosts, placement_loads
from moebal.planner.plan import ExpertPlacement
from moebal.sim.engine import Engine
from moebal.sim.program import _split_placement

__all__ = ["simulate_moe_layer"]


def simulate_moe_layer(counts_RE: np.ndarray, placement: ExpertPlacement, costs: MoELayerCosts,
                       overlap: bool = False) -> float:
    """Seconds of the layer (plus the non-MoE compute around it when `overlap`)."""
    c_RE = np.asarray(counts_RE, dtype=np.float64)
    R, E = c_RE.shape
    B = costs.a2a_bw(float(placement_loads(c_RE, placement)[1].max()) * costs.token_bytes)
    link = LinkSpec(bandwidth=B, latency_s=0.0)
    prof = HardwareProfile(name="pro-prophet-layer", gpus_per_node=1, flops={"fp32": 1.0},
                           gemm=GemmSpec(max_efficiency=1.0, half_dim=0.0), memory_bandwidth=1.0, memory_bytes=1.0,
                           intra=link, inter=link)
    cost = CostModel(prof, "fp32")
    topo = cost.topology(R)
    local_RE, remote_RE, own_RE = _split_placement(c_RE, placement)
    send_RR = np.zeros((R, R))
    for e in range(E):
        send_RR[:, placement.owner[e]] += remote_RE[:, e]
    np.fill_diagonal(send_RR, 0.0)
    disp = cost.all_to_all(topo, range(R), send_RR * costs.token_bytes)
    comb = cost.all_to_all(topo, range(R), send_RR.T * costs.token_bytes)
    H_R = (local_RE + remote_RE.sum(axis=0)[None, :] * own_RE).sum(axis=1)
    # Trans/Agg bytes scaled so that one expert's chain takes param_bytes / trans_bandwidth on these links.
    groups = [(placement.owner[e], placement.holders(e)) for e in placement.replicated]
    trans = cost.broadcast_many(topo, groups, costs.expert_param_bytes * B / costs.trans_bandwidth)
    agg = cost.broadcast_many(topo, groups, costs.expert_grad_bytes * B / costs.agg_bandwidth, kind="reduce")
    eng = Engine(topo)
    ranks = list(range(R))
    pre = eng.compute_many(ranks, "compute", [costs.nonmoe_fwd_s if overlap else 0.0] * R, "FNEC")
    t_ops = eng.collective(trans, "aux", "trans") if trans.phases else []
    t_dep = {r: o for r, o in zip(trans.ranks, t_ops)}
    ops = eng.collective(disp, "ep", "a2a", deps=[[o] for o in pre])
    fec = eng.compute_many(ranks, "compute", (H_R / costs.expert_tokens_per_s).tolist(), "FEC",
                           deps=[[ops[r], t_dep.get(r, -1)] for r in ranks])
    ops = eng.collective(comb, "ep", "a2a", deps=[[o] for o in fec])
    ops = eng.collective(disp, "ep", "a2a", deps=[[o] for o in ops])
    bec = eng.compute_many(ranks, "compute", (costs.backward_factor * H_R / costs.expert_tokens_per_s).tolist(),
                           "BEC", deps=[[o] for o in ops])
    ops = eng.collective(comb, "ep", "a2a", deps=[[o] for o in bec])
    if agg.phases:
        eng.collective(agg, "aux", "agg", deps=[[o] for o in (bec[r] for r in agg.ranks)])
    eng.compute_many(ranks, "compute", [costs.nonmoe_bwd_s if overlap else 0.0] * R, "BNEC",
                     deps=[[o] for o in ops])
    return eng.run().makespan
