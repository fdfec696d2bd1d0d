"""The discrete-event simulator: closed forms, link sharing, schedules, routing, the trace."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from moebal.errors import ConfigError, DataError
from moebal.planner.cost import CostModel, ModelShape
from moebal.planner.hardware import load_profile
from moebal.planner.plan import ExpertPlacement
from moebal.sim.engine import Engine, SimulationError
from moebal.sim.pipeline import simulate_pipeline
from moebal.sim.program import Layout, SimSpec, pipeline_order
from moebal.sim.routing import LoggedRouting, SyntheticRouting, write_routing_log, zipf_exponent_for
from moebal.sim.simulate import simulate, write_chrome_trace

TINY = ModelShape(dim=512, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=64, ffn_dim=1024, vocab_size=1000,
                  num_experts=8, top_k=2, expert_ffn_dim=1024)


def _run(cost: CostModel, ranks: int = 8, ep: int = 8, pp: int = 1, m: int = 1, **kw):
    spec = SimSpec(layout=Layout(ranks, pp=pp, ep=ep), micro_batches=m, micro_batch_size=1, seq_len=512, **kw)
    counts = SyntheticRouting(num_layers=TINY.n_layers, num_experts=8, top_k=2, zipf_s=1.0).counts(
        1, spec.layout.groups, ep, m * 512)
    return simulate(TINY, cost, spec, counts)


def test_engine_single_flow_matches_the_cost_model() -> None:
    cm = CostModel("a100", "bf16")
    topo = cm.topology(8)
    coll = cm.p2p(topo, 0, 5, 3e8)
    eng = Engine(topo)
    eng.collective(coll, "comm", "send")
    assert eng.run().makespan == pytest.approx(cm.time_of(coll, topo))


def test_two_flows_share_a_link_equally() -> None:
    cm = CostModel("a100", "bf16")
    topo = cm.topology(8)
    a, b = cm.p2p(topo, 0, 4, 1e9), cm.p2p(topo, 1, 5, 1e9)  # both cross node 0's single NIC
    eng = Engine(topo)
    eng.collective(a, "s1", "a")
    eng.collective(b, "s2", "b")
    lat = cm.profile.inter.latency_s
    assert eng.run().makespan == pytest.approx(lat + 2 * (cm.time_of(a, topo) - lat))


def test_all_to_all_is_slowed_by_a_concurrent_all_reduce_and_priority_removes_it() -> None:
    """Lina: an all-to-all overlapping an all-reduce on the same NICs runs slower; all-reducing in chunks that
    are issued only while no all-to-all is registered leaves it at most one chunk to share the links with."""
    cm = CostModel("a100", "bf16")
    topo = cm.topology(8)
    b = np.full((8, 8), 2e7)
    np.fill_diagonal(b, 0)
    a2a, chunk = cm.all_to_all(topo, range(8), b), cm.all_reduce(topo, range(8), 2e7)
    alone = cm.time_of(a2a, topo)
    times = {}
    for gated in (False, True):
        eng = Engine(topo)
        ar_ops = [eng.collective(chunk, "dp", f"allreduce{k}", gated=gated)[0] for k in range(10)]
        a2a_ops = eng.collective(a2a, "ep", "a2a", priority=gated)
        res = eng.run()
        times[gated] = (res.op_end[a2a_ops[0]] - res.op_start[a2a_ops[0]], res.op_end[ar_ops[-1]])
    assert times[False][0] > 1.5 * alone
    assert alone < times[True][0] < 1.2 * alone
    assert times[True][1] > 0  # every chunk still runs (work conservation)


def test_deadlock_is_reported() -> None:
    cm = CostModel("a100", "bf16")
    topo = cm.topology(2)
    eng = Engine(topo)
    eng.collective(cm.p2p(topo, 0, 1, 10.0), ["out", "in"], "send", deps=[[], []])
    eng.compute(1, "compute", 1.0, "waits")
    eng.add_dep(0, 2)  # the send waits for a compute that waits for ... itself through the stream? no: a cycle
    eng.add_dep(2, 1)
    with pytest.raises(SimulationError, match="never finished"):
        eng.run()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p, m", [(4, 8), (8, 32), (3, 1)])
def test_equal_stage_pipeline_bubble_is_closed_form(schedule: str, p: int, m: int) -> None:
    r = simulate_pipeline([1.0] * 2 * p, [2.0] * 2 * p, [2] * p, m, schedule)
    assert r.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    assert r.iteration_time_s == pytest.approx((m + p - 1) * 2 * 3.0)


def test_1f1b_order_is_complete_and_causal() -> None:
    for s in range(4):
        order = pipeline_order("1f1b", s, 4, 6)
        assert sorted(order) == sorted([("F", j) for j in range(6)] + [("B", j) for j in range(6)])
        seen = set()
        for kind, j in order:
            if kind == "B":
                assert ("F", j) in seen
            seen.add((kind, j))


def test_imbalanced_stage_sets_the_pace() -> None:
    bal = simulate_pipeline([1.0] * 8, [2.0] * 8, [2, 2, 2, 2], 16)
    imb = simulate_pipeline([1.0] * 8, [2.0] * 8, [1, 2, 2, 3], 16)
    assert imb.iteration_time_s > bal.iteration_time_s and imb.bubble_ratio > bal.bubble_ratio


def test_full_iteration_figures_are_consistent() -> None:
    res = _run(CostModel("a100", "bf16"), ranks=16, ep=8)
    d = res.to_dict()
    assert d["iteration_time_s"] > 0 and 0 <= d["bubble_ratio"] < 1
    assert np.all(res.busy_s <= res.iteration_time_s + 1e-12)
    assert d["comm_s"]["a2a"] > 0 and d["comm_s"]["allreduce"] > 0
    assert d["bytes_by_link_class"]["nic_out"] > 0  # the expert-DP all-reduce crosses nodes


def test_more_bandwidth_is_never_slower_end_to_end() -> None:
    base = load_profile("a100")
    times = []
    for k in (1.0, 2.0, 8.0):
        prof = dataclasses.replace(base, inter=dataclasses.replace(base.inter, bandwidth=k * base.inter.bandwidth),
                                   intra=dataclasses.replace(base.intra, bandwidth=k * base.intra.bandwidth))
        times.append(_run(CostModel(prof, "bf16"), ranks=16, ep=8).iteration_time_s)
    assert times[0] >= times[1] >= times[2]


def test_pipeline_program_bubble_matches_closed_form_when_comm_is_free() -> None:
    base = load_profile("h100")
    free = dataclasses.replace(base, inter=dataclasses.replace(base.inter, bandwidth=1e18, latency_s=0.0),
                               intra=dataclasses.replace(base.intra, bandwidth=1e18, latency_s=0.0))
    # wide layers, a tiny vocabulary: embedding and head are negligible next to a layer
    dense = ModelShape(dim=4096, n_layers=8, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=65536, vocab_size=8)
    spec = SimSpec(layout=Layout(4, pp=4, ep=1), micro_batches=8, micro_batch_size=1, seq_len=2048, optimizer=False)
    res = simulate(dense, CostModel(free, "bf16"), spec, None)
    assert res.bubble_ratio == pytest.approx(3 / 11, abs=0.01)


def test_placement_with_replicas_sends_fewer_tokens() -> None:
    cm = CostModel("rtx3090", "fp32")
    spec = SimSpec(layout=Layout(8, ep=8), micro_batch_size=2, seq_len=256, trans_overlap=True)
    counts = SyntheticRouting(num_layers=4, num_experts=8, top_k=2, zipf_s=1.5).counts(1, 1, 8, 512)
    hot = int(np.argmax(counts[0, 0].sum(axis=0)))
    rep = ExpertPlacement(num_ranks=8, owner=tuple(range(8)),
                          replicas=tuple(tuple(r for r in range(8) if r != e) if e == hot else () for e in range(8)))
    static = [[ExpertPlacement.static(8, 8)] for _ in range(4)]
    plans = [[rep]] + static[1:]
    a = simulate(TINY, cm, spec, counts, static)
    b = simulate(TINY, cm, spec, counts, plans)
    assert b.comm_s["trans"] > 0 and b.comm_s["agg"] > 0
    assert b.bytes_by_link_class["nic_in"] != a.bytes_by_link_class["nic_in"]


def test_placements_price_the_overlap_window_of_one_micro_batch(monkeypatch) -> None:
    # the program issues Trans in micro-batch 0's forward and Agg in the last one's backward: eq. 8 may hide them
    # under one micro-batch's compute, not the step's (it once used the step's: 8x the window at M = 8)
    import moebal.planner.placement as placement
    from moebal.sim.simulate import plan_placements

    seen: list[float] = []
    costs: list = []
    real = placement.plan_experts

    def spy(counts, policy, cost, owner=None, **opts):
        seen.append(cost.overlap_share)
        costs.append(cost)
        return real(counts, policy, cost, owner, **opts)

    monkeypatch.setattr(placement, "plan_experts", spy)
    cm = CostModel("h100", "bf16")
    one = cm.moe_layer_costs(TINY, list(range(8)), 512, 512, num_ranks=16)  # one micro-batch of stage 0's group
    for m in (1, 4):
        spec = SimSpec(layout=Layout(16, pp=2, ep=8), micro_batches=m, micro_batch_size=1, seq_len=512)
        predicted = SyntheticRouting(num_layers=4, num_experts=8, top_k=2, zipf_s=1.5).counts(
            0, spec.layout.groups, 8, m * 512)
        plan_placements("prophet", cm, TINY, spec, predicted, [2, 2], overlap=True)
        assert seen and set(seen) == {1.0 / m}
        # the program's expert GEMMs run one micro-batch's rows; the non-MoE work is all M micro-batches'
        assert costs[0].expert_tokens_per_s == one.expert_tokens_per_s
        assert costs[0].nonmoe_fwd_s == pytest.approx(m * one.nonmoe_fwd_s)
        seen.clear()
        costs.clear()


def test_bad_layouts_are_clear() -> None:
    with pytest.raises(ConfigError, match="multiple of parallel.pp"):
        Layout(10, pp=4)
    with pytest.raises(ConfigError, match="must divide the data-parallel size"):
        Layout(12, pp=1, ep=8)
    with pytest.raises(ConfigError, match="routing counts of layer 0 have shape"):
        simulate(TINY, CostModel("a100", "bf16"), SimSpec(layout=Layout(8, ep=8), seq_len=64), np.ones((4, 1, 4, 8)))


def test_synthetic_routing_matches_the_pro_prophet_description() -> None:
    s = zipf_exponent_for(16)
    c = SyntheticRouting(num_layers=3, num_experts=16, top_k=1, zipf_s=s, seed=3).counts(0, 1, 16, 4096)
    load = np.sort(c.sum(axis=(1, 2)), axis=1)[:, ::-1]
    share = load / load.sum(axis=1, keepdims=True)
    assert np.all(share[:, :3].sum(axis=1) > 0.5) and np.all(share[:, -3:].sum(axis=1) < 0.06)
    assert np.allclose(c.sum(axis=-1), 4096)


def test_synthetic_routing_grows_more_skewed_as_the_exponent_rises_past_the_one_per_token_cap() -> None:
    # the hottest expert caps at one assignment per token; its excess once went to the others by their room
    # (nearly uniform), so past Zipf 1.5 at top-2 the tail flattened as the exponent rose
    T, shares = 4096, []
    for s in (1.0, 2.0, 3.0, 5.0):
        c = SyntheticRouting(num_layers=1, num_experts=8, top_k=2, zipf_s=s, drift=0.0).counts(0, 1, 4, T)
        assert c.max() <= T and np.allclose(c.sum(axis=-1), 2 * T)  # capped, every assignment kept
        load = np.sort(c.sum(axis=(0, 1, 2)))[::-1]
        shares.append(load / load.sum())
    lightest = [sh[-1] for sh in shares]
    assert all(a > b for a, b in zip(lightest, lightest[1:])), lightest
    assert shares[2][1] > 0.3  # Zipf 3: the second expert takes most second choices (0.29 of 1 before)


def test_synthetic_routing_drifts_slowly_and_is_seeded() -> None:
    r = SyntheticRouting(num_layers=2, num_experts=8, top_k=2, zipf_s=1.0, drift=0.05, seed=1)
    a, b, far = r.popularity(10), r.popularity(11), r.popularity(400)
    assert np.abs(a - b).sum() < np.abs(a - far).sum()
    assert np.array_equal(r.counts(5, 1, 4, 100), r.counts(5, 1, 4, 100))


def test_routing_log_round_trip_and_rescaling(tmp_path) -> None:
    steps = [np.arange(2 * 3 * 4, dtype=float).reshape(2, 3, 4) + i for i in range(2)]
    path = tmp_path / "routing.jsonl"
    write_routing_log(path, steps)
    log = LoggedRouting.from_file(path)
    c = log.counts(1, num_layers=4, groups=2, ranks=4, tokens_per_rank=10, top_k=2)
    assert c.shape == (4, 2, 4, 4) and np.allclose(c.sum(axis=-1), 20)
    row = steps[1][0, 0] / steps[1][0, 0].sum()
    assert np.allclose(c[0, 0, 0] / 20, row) and np.allclose(c[2], c[0])  # layers cycle


def test_a_logs_steps_are_the_steps_it_names(tmp_path) -> None:
    # a run logs every train.log_every steps: step 20 is the line that says 20, and the step before it the line
    # before (K once picked line K mod n, so --step 20 of a log of steps 10, 20, 30 replayed step 30)
    steps = [np.full((1, 2, 4), float(i + 1)) for i in range(3)]
    path = tmp_path / "plans.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, c in enumerate(steps):
            f.write(json.dumps({"step": 10 * (i + 1), "counts": (c * [[[1, 2, 3, 4]]]).tolist()}) + "\n")
    log = LoggedRouting.from_file(path)
    assert log.step_ids == (10, 20, 30) and log.first_replayable() == 20 and log.previous(30) == 20
    assert np.array_equal(log.counts(20, 1, 1, 2, 100, 2), log.counts(20, 1, 1, 2, 100, 2))
    with pytest.raises(ConfigError, match=r"step 25 is not in the routing log \(its 3 logged steps: 10, 20, 30\)"):
        log.counts(25, 1, 1, 2, 100, 2)
    with pytest.raises(ConfigError, match="step 10 is the routing log's first"):
        log.previous(10)
    write_routing_log(path, steps)  # steps 0, 1, 2
    assert LoggedRouting.from_file(path).previous(2) == 1
    path.write_text("".join(json.dumps({"counts": c.tolist()}) + "\n" for c in steps))  # no steps: line indices
    unnamed = LoggedRouting.from_file(path)
    assert unnamed.step_ids is None and unnamed.previous(4) == 3 and unnamed.first_replayable() == 1


def test_bad_routing_logs_are_clear(tmp_path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"step": 0, "counts": [[1, 2], [3]]}\n')
    with pytest.raises(DataError, match="layers x ranks x experts"):
        LoggedRouting.from_file(p)
    p.write_text("not json\n")
    with pytest.raises(DataError, match="not a JSON object"):
        LoggedRouting.from_file(p)
    p.write_text('{"step": 0}\n')
    with pytest.raises(DataError, match="no line with a 'counts' field"):
        LoggedRouting.from_file(p)


def test_trace_is_valid_json_with_one_track_per_rank(tmp_path) -> None:
    res = _run(CostModel("a100", "bf16"), ranks=8, ep=4, pp=2, m=4)
    path = tmp_path / "trace.json"
    assert res.engine is not None
    write_chrome_trace(res.engine, path)
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(8)}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(8))
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(res.iteration_time_s * 1e6, rel=1e-6)


# ---- Pro-Prophet's worked example (docs of seed-002 section 6): unit costs, D = E = 4 ----------------------
_C_RE = np.array([[40, 5, 5, 10], [30, 10, 10, 10], [30, 10, 10, 10], [20, 15, 15, 10]], dtype=float)


def _unit_costs():
    from moebal.planner.perf import MoELayerCosts

    return MoELayerCosts(token_bytes=1.0, expert_param_bytes=50.0, expert_grad_bytes=50.0, expert_tokens_per_s=1.0,
                         a2a_bandwidth=1.0, trans_bandwidth=1.0, agg_bandwidth=1.0, nonmoe_fwd_s=30.0,
                         nonmoe_bwd_s=60.0)


@pytest.mark.parametrize("replicas, eq6", [(((), (), (), ()), 680.0), (((1, 2, 3), (), (), ()), 430.0)])
def test_simulated_moe_layer_reproduces_eq6(replicas, eq6) -> None:
    from moebal.planner.perf import evaluate
    from moebal.sim.layer import simulate_moe_layer

    pl = ExpertPlacement(num_ranks=4, owner=(0, 1, 2, 3), replicas=replicas)
    costs = _unit_costs()
    assert evaluate(_C_RE, pl, costs).total_s == pytest.approx(eq6)
    assert simulate_moe_layer(_C_RE, pl, costs) == pytest.approx(eq6)
    # with the non-MoE compute around the layer, overlapping Trans/Agg never loses and never beats eq. 8
    around = costs.nonmoe_fwd_s + costs.nonmoe_bwd_s
    sim = simulate_moe_layer(_C_RE, pl, costs, overlap=True)
    assert evaluate(_C_RE, pl, costs, overlap=True).total_s + around - 1e-9 <= sim <= eq6 + around + 1e-9


def test_deepspeed_capacity_padding_sends_and_computes_the_maximum() -> None:
    cm = CostModel("a100", "bf16")
    counts = SyntheticRouting(num_layers=TINY.n_layers, num_experts=8, top_k=2, zipf_s=1.5).counts(1, 1, 8, 512)
    exact = SimSpec(layout=Layout(8, ep=8), seq_len=512, optimizer=False)
    padded = dataclasses.replace(exact, a2a_padding="capacity")
    a, b = simulate(TINY, cm, exact, counts), simulate(TINY, cm, padded, counts)
    assert b.bytes_by_link_class["nic_in"] > a.bytes_by_link_class["nic_in"]
    assert b.iteration_time_s > a.iteration_time_s
    assert np.ptp(b.busy_s) < 1e-9  # every expert computes the padded rows: ranks are equally busy
    with pytest.raises(ConfigError, match="a2a_padding"):
        simulate(TINY, cm, dataclasses.replace(exact, a2a_padding="pad"), counts)


def test_fanout_loads_the_root_and_chains_do_not() -> None:
    cm = CostModel("a100", "bf16")
    topo = cm.topology(4)
    fan = cm.fanout(topo, 0, range(4), 1e6)
    chain = cm.broadcast(topo, 0, range(4), 1e6)
    assert fan.phases[0].nbytes.max() == pytest.approx(3e6) and chain.phases[0].nbytes.max() == pytest.approx(1e6)
    many = cm.broadcast_many(topo, [(0, [0, 1, 2]), (3, [3, 1])], 1e6)
    ref = cm.grouped([cm.broadcast(topo, 0, [0, 1, 2], 1e6), cm.broadcast(topo, 3, [3, 1], 1e6)], "broadcast")
    assert np.array_equal(many.phases[0].links, ref.phases[0].links)
    assert np.allclose(many.phases[0].nbytes, ref.phases[0].nbytes) and many.ranks == ref.ranks
    # a chain leaves each node once: the root's node-mates first, whatever the root's node id (4 GPUs a node
    # on h100 here: 17 and 18 on node 4, 1 and 2 on node 0, 9 and 10 on node 2)
    cm = CostModel("h100", "bf16")
    topo = cm.topology(32)
    assert topo.node_R[[1, 9, 17]].tolist() == [0, 2, 4]
    chain = cm.broadcast(topo, 17, [1, 2, 9, 10, 17, 18], 1e6)
    assert chain.ranks == (17, 18, 1, 2, 9, 10)
    many = cm.broadcast_many(topo, [(17, [1, 2, 9, 10, 17, 18])], 1e6)
    assert np.array_equal(many.phases[0].links, chain.phases[0].links)
    lo, hi = next((a, b) for a, b, label in topo.link_classes() if label == "nic_out")
    links, nbytes = chain.phases[0].links, chain.phases[0].nbytes
    assert nbytes[(links >= lo) & (links < hi)].sum() == pytest.approx(2e6)  # two node crossings, not three


def test_eager_compute_settling_matches_a_fully_event_driven_run() -> None:
    from moebal.sim.engine import _Run
    from moebal.sim.program import build_program

    cm = CostModel("h100", "bf16")
    spec = SimSpec(layout=Layout(16, pp=2, ep=4), micro_batches=4, seq_len=256, trans_overlap=True)
    counts = SyntheticRouting(num_layers=TINY.n_layers, num_experts=8, top_k=2, zipf_s=1.2).counts(1, 2, 4, 1024)
    rep = ExpertPlacement(num_ranks=4, owner=(0, 0, 1, 1, 2, 2, 3, 3), replicas=((1, 2), (), (), (), (), (), (), ()))
    eng = build_program(cm, TINY, spec, counts, [[rep, rep]] * TINY.n_layers, cm.topology(16))
    runs = []
    for eager in (True, False):
        run = _Run(eng)
        run.eager = eager
        runs.append(run.go())
    assert np.allclose(runs[0].op_end, runs[1].op_end) and np.allclose(runs[0].op_start, runs[1].op_start)


def test_block_wise_trans_of_a_layer_starts_with_the_layer_before() -> None:
    """Pro-Prophet's scheduler issues layer l's Trans when layer l - 1 starts (not all of them at the iteration's
    start), on the aux stream; without it Trans waits for the layer before to end, on the ep stream."""
    from moebal.sim.program import build_program

    cm = CostModel("h100", "bf16")
    counts = SyntheticRouting(num_layers=TINY.n_layers, num_experts=8, top_k=2, zipf_s=1.2).counts(1, 1, 4, 1024)
    rep = ExpertPlacement(num_ranks=4, owner=(0, 0, 1, 1, 2, 2, 3, 3), replicas=((1, 2), (), (), (), (), (), (), ()))
    for overlap in (True, False):
        spec = SimSpec(layout=Layout(4, ep=4), micro_batches=2, seq_len=256, trans_overlap=overlap)
        res = build_program(cm, TINY, spec, counts, [[rep]] * TINY.n_layers, cm.topology(4)).run()

        def at(name: str, rank: int, what: np.ndarray, res=res) -> float:
            return float(what[next(i for i, n in enumerate(res.op_name) if n == name and res.op_rank[i] == rank)])

        for rank in (1, 2):  # the holders of expert 0's replicas
            for layer in range(1, TINY.n_layers):
                trans = at(f"L{layer} trans", rank, res.op_start)
                if overlap:  # issued when the block before starts (queued behind earlier Trans on the aux stream)
                    before = at(f"F0 L{layer - 1} attn", rank, res.op_start)
                    assert before - 1e-12 <= trans < at(f"F0 L{layer} attn", rank, res.op_start), (rank, layer)
                    if layer >= 2:
                        assert trans == pytest.approx(before)
                else:  # after the block before, on the ep stream ahead of the layer's exchanges
                    assert trans >= at(f"F0 L{layer - 1} a2a0'", rank, res.op_end) - 1e-12
                    assert at(f"F0 L{layer} counts", rank, res.op_start) >= at(f"L{layer} trans", rank, res.op_end)


def test_recompute_adds_the_rerun_forward_to_the_backward_on_one_rank() -> None:
    """One rank, a dense model, no communication: the step grows by exactly the recomputed forward ops."""
    cost = CostModel("h100", "bf16")
    dense = dataclasses.replace(TINY, num_experts=0)
    B, T = 2, 512
    base = SimSpec(layout=Layout(1), micro_batch_size=B, seq_len=T, count_exchange=False, optimizer=False)
    t = {rc: simulate(dense, cost, dataclasses.replace(base, recompute=rc), None).iteration_time_s
         for rc in ("none", "moe", "attention", "full")}
    attn = cost.attention_s(dense, B, T, False) * dense.n_layers
    mlp = cost.dense_mlp_s(dense, B * T, False) * dense.n_layers
    assert t["attention"] - t["none"] == pytest.approx(attn, rel=1e-9)
    assert t["moe"] - t["none"] == pytest.approx(mlp, rel=1e-9)
    assert t["full"] - t["none"] == pytest.approx(attn + mlp, rel=1e-9)
    with pytest.raises(ConfigError, match="recompute must be one of"):
        simulate(dense, cost, dataclasses.replace(base, recompute="all"), None)


def test_recompute_under_expert_parallelism_reruns_the_expert_gemms_not_the_all_to_alls() -> None:
    cost = CostModel("h100", "bf16")
    none, moe = _run(cost), _run(cost, recompute="moe")
    assert moe.iteration_time_s > none.iteration_time_s
    assert moe.bytes_by_link_class == none.bytes_by_link_class  # the same traffic: no all-to-all is rerun
    assert moe.busy_s.sum() > none.busy_s.sum()


def test_stats_allreduce_adds_one_small_all_reduce_per_moe_layer_pass() -> None:
    """Two symmetric ranks (uniform routing), every op on the critical path: the balancing statistics'
    all-reduce adds exactly its cost-model time once in the forward and once in the backward of each MoE layer."""
    cost = CostModel("h100", "bf16")
    R, T = 2, 512
    spec = SimSpec(layout=Layout(R, ep=R), micro_batch_size=1, seq_len=T, optimizer=False, dp_overlap=False)
    counts = np.full((TINY.n_layers, 1, R, TINY.num_experts), T * TINY.top_k / TINY.num_experts)
    base = simulate(TINY, cost, spec, counts)
    stats = simulate(TINY, cost, dataclasses.replace(spec, stats_allreduce=True), counts)
    topo = cost.topology(R)
    one = cost.time_of(cost.all_reduce(topo, range(R), 4.0 * (2 * TINY.num_experts + 1)), topo)
    assert one > 0
    assert stats.iteration_time_s - base.iteration_time_s == pytest.approx(2 * TINY.n_layers * one, rel=1e-9)
    assert stats.comm_s["stats"] == pytest.approx(2 * TINY.n_layers * one, rel=1e-9)
    assert "stats" not in base.comm_s


def test_moe_pass_overhead_adds_its_time_once_per_moe_layer_pass_under_ep_only() -> None:
    cost = CostModel("h100", "bf16")
    R, T, h = 2, 512, 3e-3
    spec = SimSpec(layout=Layout(R, ep=R), micro_batch_size=1, seq_len=T, optimizer=False, dp_overlap=False)
    counts = np.full((TINY.n_layers, 1, R, TINY.num_experts), T * TINY.top_k / TINY.num_experts)
    base = simulate(TINY, cost, spec, counts).iteration_time_s
    more = simulate(TINY, cost, dataclasses.replace(spec, moe_pass_overhead_s=h), counts).iteration_time_s
    assert more - base == pytest.approx(2 * TINY.n_layers * h, rel=1e-9)  # forward and backward of each layer
    one = SimSpec(layout=Layout(1), micro_batch_size=1, seq_len=T, optimizer=False, count_exchange=False)
    c1 = counts[:, :, :1]
    assert simulate(TINY, cost, dataclasses.replace(one, moe_pass_overhead_s=h), c1).iteration_time_s == \
        simulate(TINY, cost, one, c1).iteration_time_s  # ep 1: no expert-parallel machinery
    with pytest.raises(ConfigError, match="moe_pass_overhead_s"):
        simulate(TINY, cost, dataclasses.replace(spec, moe_pass_overhead_s=-1.0), counts)


def test_tied_embeddings_across_stages_send_the_head_gradient_and_the_stepped_weight() -> None:
    """moebal/pipeline/tied.py in the simulator: per pipeline, the last stage's head-copy gradient goes to the
    first stage before the embedding's data-parallel sum and optimizer, and the stepped weight comes back after
    the first stage's optimizer; both V x D x 4 bytes (the weight 2 with bf16 compute copies). An untied model
    sends neither."""
    from moebal.sim.program import build_program

    cm = CostModel("h100", "bf16")
    spec = SimSpec(layout=Layout(8, pp=2, ep=2), micro_batches=2, micro_batch_size=1, seq_len=256)
    counts = SyntheticRouting(num_layers=TINY.n_layers, num_experts=8, top_k=2, zipf_s=1.0).counts(
        1, spec.layout.groups, 2, 512)
    runs = {}
    for tie in (False, True):
        shape = dataclasses.replace(TINY, tie_embeddings=tie)
        runs[tie] = build_program(cm, shape, spec, counts, None, cm.topology(8)).run()
    plain, tied = runs[False], runs[True]
    assert not any(n.startswith("tie ") for n in plain.op_name)
    name = np.array(tied.op_name)
    ranks = tied.op_rank
    first, last = spec.layout.stage_ranks(0), spec.layout.stage_ranks(1)
    want = cm.p2p(cm.topology(8), int(last[0]), int(first[0]), TINY.vocab_size * TINY.dim * 4.0)
    eng = Engine(cm.topology(8))
    eng.collective(want, ["out", "in"], "alone", "p2p")
    alone = eng.run().makespan
    assert alone > 0
    for kind in ("grad", "weight"):
        ops = np.flatnonzero(name == f"tie {kind} send")
        assert len(ops) == 2 * len(first)  # a send and a receive per pipeline
    for a, b in zip(first, last):
        recv = [i for i in np.flatnonzero(name == "tie grad send") if ranks[i] == a][0]
        opt = [i for i in np.flatnonzero(name == "optimizer") if ranks[i] == a][0]
        assert tied.op_end[recv] <= tied.op_start[opt]
        back = [i for i in np.flatnonzero(name == "tie weight send") if ranks[i] == b][0]
        assert tied.op_start[back] >= tied.op_end[opt]
        assert tied.op_end[back] - tied.op_start[back] >= alone * (1 - 1e-9)  # the V x D x 4 bytes, or slower
    assert tied.makespan > plain.makespan
    # bf16 compute copies (`tie_weight_bytes` 2): the weight's message carries half the bytes, the gradient's the same
    half = build_program(cm, dataclasses.replace(TINY, tie_embeddings=True),
                         dataclasses.replace(spec, tie_weight_bytes=2), counts, None, cm.topology(8)).run()

    def seconds(run, kind):
        ops = [i for i in np.flatnonzero(np.array(run.op_name) == f"tie {kind} send") if run.op_rank[i] == last[0]]
        return run.op_end[ops[0]] - run.op_start[ops[0]]

    assert seconds(half, "weight") < seconds(tied, "weight")
    assert seconds(half, "grad") == pytest.approx(seconds(tied, "grad"))


def test_agg_sends_the_replica_gradients_in_the_compute_dtype_as_the_executor(monkeypatch) -> None:
    # `ExpertParallel` sends replicas and their gradients in its wire dtype (the compute dtype): under bf16, Agg's
    # bytes are Trans's, whatever SimSpec.grad_bytes (the fp32 main gradients of the data-parallel all-reduce)
    cm = CostModel("h100", "bf16")
    sent: dict[str, list[float]] = {"broadcast": [], "reduce": []}
    real = cm.broadcast_many

    def spy(topo, groups, nbytes, kind="broadcast", algorithm="chain"):
        sent[kind].append(nbytes)
        return real(topo, groups, nbytes, kind, algorithm)

    monkeypatch.setattr(cm, "broadcast_many", spy)
    spec = SimSpec(layout=Layout(8, ep=8), micro_batch_size=2, seq_len=256, trans_overlap=True, grad_bytes=4)
    counts = SyntheticRouting(num_layers=4, num_experts=8, top_k=2, zipf_s=1.5).counts(1, 1, 8, 512)
    rep = ExpertPlacement(num_ranks=8, owner=tuple(range(8)), replicas=((1, 2),) + ((),) * 7)
    simulate(TINY, cm, spec, counts, [[rep]] + [[ExpertPlacement.static(8, 8)]] * 3)
    assert sent["broadcast"] and sent["reduce"] == sent["broadcast"] == [TINY.expert_params * 2]
