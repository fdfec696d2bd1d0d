"""CostModel and hardware profiles: closed forms, monotonicity, clear errors."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from moebal.errors import ConfigError
from moebal.planner.cost import CostModel, ModelShape
from moebal.planner.hardware import list_profiles, load_profile, profile_from_dict, profile_to_dict

MIXTRAL = ModelShape(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336, vocab_size=32000,
                     num_experts=8, top_k=2, expert_ffn_dim=14336)


def test_shipped_profiles_load_and_cite_sources() -> None:
    names = list_profiles()
    assert {"h100", "a100", "rtx3090", "rtx2080ti", "rtx3090-nvlink", "h100-ndr400"} <= set(names)
    for n in names:
        p = load_profile(n)
        assert p.source, f"profile {n} must cite its datasheet figures"
        assert p.inter.capacity > 0 and p.intra.capacity > 0


PROVENANCE = ("datasheet", "whitepaper", "specification", "assumption", "fitted", "section", "appendix", "thesis",
              "Gb/s", "PCIe", "GB/s")


def test_every_constant_of_a_shipped_profile_says_where_it_comes_from() -> None:
    """A number in configs/hardware/ carries its provenance on its line: datasheet (or whitepaper,
    specification, the paper's cluster), a link rate, an assumption, or fitted on named data."""
    folder = Path(__file__).resolve().parents[2] / "configs" / "hardware"
    missing = []
    for path in sorted(folder.glob("*.yaml")):
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            value, _, comment = line.partition("#")
            if re.fullmatch(r"\s*[a-z_0-9]+:\s*[-+0-9.e]+\s*", value) and not any(w in comment for w in PROVENANCE):
                missing.append(f"{path.name}:{no}: {line.strip()}")
    assert not missing, "constants without provenance:\n" + "\n".join(missing)


def test_profile_round_trips_through_yaml_dict() -> None:
    p = load_profile("rtx3090-nvlink")
    assert profile_from_dict(profile_to_dict(p)) == p


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(gpus_per_nod=4), "did you mean 'gpus_per_node'"),
    (lambda d: d["inter"].update(bandwidth=-1.0), "inter.bandwidth must be > 0"),
    (lambda d: d.pop("flops"), "missing required key(s) flops"),
    (lambda d: d["flops"].update(fp8=1e15), "flops.fp8: unknown dtype"),
    (lambda d: d.update(fabric="ethernet"), "'fabric' must be one of switch, pcie"),
    (lambda d: d.update(nics_per_node=16), "nics_per_node must be in 1..gpus_per_node"),
])
def test_bad_profiles_name_the_problem(edit, message) -> None:
    d = profile_to_dict(load_profile("a100"))
    edit(d)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        profile_from_dict(d, source="bad.yaml")


def test_a_retired_profile_key_is_refused_saying_why() -> None:
    data = profile_to_dict(load_profile("h100"))
    data["backward_factor"] = 2.0
    with pytest.raises(ConfigError, match="'backward_factor' is no longer a profile key: no planner read it"):
        profile_from_dict(data, source="old.yaml")


def test_unknown_profile_suggests_a_name() -> None:
    with pytest.raises(ConfigError, match="did you mean 'h100'"):
        load_profile("h10")


def test_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no matmul rate for dtype 'bf16'"):
        CostModel("rtx2080ti", "bf16")


def test_gemm_efficiency_rises_with_size_and_stays_below_peak() -> None:
    cm = CostModel("h100", "bf16")
    m = np.array([16, 64, 256, 1024, 4096, 16384])
    rate = 2 * m * 4096 * 4096 / cm.gemm_s(m, 4096, 4096)
    assert np.all(np.diff(rate) > 0)
    assert rate[-1] < cm.peak * cm.profile.gemm.max_efficiency
    assert rate[0] < 0.1 * cm.peak  # small GEMMs are far below peak
    assert cm.gemm_s(0, 4096, 4096) == 0.0


def test_single_link_and_ring_all_reduce_closed_forms() -> None:
    cm = CostModel("a100", "bf16")
    p = cm.profile
    topo = cm.topology(8)
    S = 1e9
    # one message across nodes: latency + S / (NIC capacity)
    assert cm.time_of(cm.p2p(topo, 0, 4, S), topo) == pytest.approx(p.inter.latency_s + S / p.inter.capacity)
    # ring all-reduce inside one node of 4: 2(n-1) alpha + 2(n-1)/n S / B
    n = 4
    ring = cm.time_of(cm.all_reduce(topo, range(n), S), topo)
    assert ring == pytest.approx(2 * (n - 1) * p.intra.latency_s + 2 * (n - 1) / n * S / p.intra.capacity)


def test_hierarchical_all_reduce_across_nodes() -> None:
    cm = CostModel("h100", "bf16")
    p, topo = cm.profile, cm.topology(16)
    S, g, N = 4e9, 4, 4
    t = cm.time_of(cm.all_reduce(topo, range(16), S), topo)
    intra = 2 * ((g - 1) * p.intra.latency_s + (g - 1) / g * S / p.intra.capacity)
    inter = 2 * (N - 1) * p.inter.latency_s + 2 * (N - 1) / N * S / g / p.inter.capacity
    assert t == pytest.approx(intra + inter)


def test_all_to_all_is_set_by_the_busiest_link() -> None:
    cm = CostModel("rtx3090", "fp32")
    topo = cm.topology(8)
    b = np.zeros((8, 8))
    b[1:, 0] = 1e6  # everyone sends 1 MB to rank 0; ranks 4..7 cross the NIC of node 1 -> node 0
    t = cm.time_of(cm.all_to_all(topo, range(8), b), topo)
    p = cm.profile
    nic = 4e6 / p.inter.capacity
    pcie = 7e6 / p.intra.capacity  # rank 0's PCIe link carries all 7 MB (the fabric is PCIe)
    assert t == pytest.approx(7 * p.inter.latency_s + max(nic, pcie))


def test_more_bandwidth_is_never_slower() -> None:
    base = load_profile("rtx3090")
    fast = dataclasses.replace(base, inter=dataclasses.replace(base.inter, bandwidth=4 * base.inter.bandwidth))
    slow_cm, fast_cm = CostModel(base, "fp32"), CostModel(fast, "fp32")
    rng = np.random.default_rng(0)
    b = rng.uniform(0, 1e7, size=(16, 16))
    for cm_pair in [(slow_cm, fast_cm)]:
        ts = [cm.time_of(cm.all_to_all(cm.topology(16), range(16), b), cm.topology(16)) for cm in cm_pair]
        tr = [cm.time_of(cm.all_reduce(cm.topology(16), range(16), 1e9), cm.topology(16)) for cm in cm_pair]
        assert ts[1] <= ts[0] and tr[1] <= tr[0]


def test_moe_layer_costs_feed_the_pro_prophet_model() -> None:
    from moebal.planner.perf import layer_time

    cm = CostModel("h100-ndr400", "bf16")
    c = cm.moe_layer_costs(MIXTRAL, range(8), tokens_per_rank=4096, seq=4096, num_ranks=8)
    assert c.token_bytes == 4096 * 2 and c.expert_param_bytes == 3 * 4096 * 14336 * 2
    # t: the expert forward at the average rows per expert (8 ranks x 4096 tokens x top-2 / 8 experts)
    rows = 8 * 4096 * 2 / 8
    assert c.expert_tokens_per_s == pytest.approx(rows / cm.experts_fwd_s(MIXTRAL, [rows]))
    # a2a bandwidth grows with message size (latency-bound small messages)
    assert c.a2a_bw(1e4) < c.a2a_bw(1e6) < c.a2a_bw(1e8)
    assert layer_time(c, 2048, 2048, 0, 8) > 0


def _synthetic_records(truth, rng) -> dict:
    """Timings a machine described by `truth` would produce (with 2 % noise)."""
    from moebal.planner.hardware_fit import collective_terms

    cm = CostModel(truth, "fp32")
    noise = lambda: float(rng.uniform(0.98, 1.02))  # noqa: E731
    gemm = [{"dtype": "fp32", "m": m, "n": n, "k": k, "s": cm.gemm_s(m, n, k) * noise()}
            for m in (16, 64, 256, 1024, 4096) for n, k in ((128, 128), (512, 256), (1024, 1024))]
    mem = [{"op": "copy", "bytes": b, "s": b / truth.memory_bandwidth * noise()} for b in (1e7, 4e7)]
    coll = []
    for kind in ("p2p", "all_to_all", "all_reduce", "broadcast"):
        for w in ((2,) if kind == "p2p" else (2, 3, 4)):
            for b in (65536, 1 << 20, 1 << 23):
                steps, demand = collective_terms(kind, w, b)
                s = steps * truth.intra.latency_s + demand / truth.intra.bandwidth
                coll.append({"kind": kind, "world": w, "bytes": b, "s": s * noise()})
    return {"gemm": gemm, "memory": mem, "attention": [], "collective": coll}


def test_calibration_fit_recovers_a_known_machine() -> None:
    import dataclasses as dc

    from moebal.planner.hardware import GemmSpec, LinkSpec
    from moebal.planner.hardware_fit import fit_profile

    base = load_profile("a100")
    truth = dc.replace(base, flops={"fp32": 1e11}, gemm=GemmSpec(max_efficiency=1.0, half_dim=16.0, launch_s=1e-5),
                       intra=LinkSpec(bandwidth=2e9, latency_s=2e-4), memory_bandwidth=2e10, memory_efficiency=1.0)
    rec = _synthetic_records(truth, np.random.default_rng(0))
    prof = fit_profile(rec, name="fit", description="", source=["test"], calibration={})
    # parameters can trade off against each other (peak vs the cache term): check predictions on other shapes
    fitted, true = CostModel(prof, "fp32"), CostModel(truth, "fp32")
    for m, n, k in ((32, 768, 384), (512, 2048, 512), (2048, 256, 256)):
        assert fitted.gemm_s(m, n, k) == pytest.approx(true.gemm_s(m, n, k), rel=0.06)
    assert prof.memory_bandwidth == pytest.approx(2e10, rel=0.03)
    assert prof.intra.bandwidth == pytest.approx(2e9, rel=0.05)
    for kind in ("all_to_all", "all_reduce", "broadcast"):
        spec = prof.collective(kind)
        assert spec.efficiency_for(3) == pytest.approx(1.0, rel=0.1)
        assert spec.latency_for(3) == pytest.approx(2e-4, rel=0.15)
    assert prof.calibration["collectives"]["all_reduce"]["median_rel_error"] < 0.03


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "llama-moe-3.5b", "qwen3-30b-a3b", "olmoe-1b-7b",
                                    "deepseek-v2-lite", "deepseek-v3"])
def test_model_shape_counts_each_presets_attention_and_the_memory_bound_holds(preset):
    """The cost model's attention parameters (grouped-query with q/k norms, or multi-head latent attention) equal
    the built layer's, and the memory check's count is a lower bound of the model (shared experts left out)."""
    from moebal.config import load
    from moebal.models.transformer import MoebalForCausalLM
    from moebal.planner.cost import ModelShape
    from moebal.train.memory import param_count

    cfg = load(preset)
    with torch.device("meta"):
        model = MoebalForCausalLM(cfg)
    layer = model.model.layers[-1]
    built = sum(p.numel() for p in layer.self_attn.parameters()) + sum(
        p.numel() for p in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight))
    assert ModelShape.from_config(cfg).attn_params == built
    total = model.num_parameters()
    assert param_count(cfg) <= total
    assert param_count(cfg) >= 0.97 * total  # only shared experts and their gates are left out


def test_the_trainers_profile_costs_price_one_micro_batch_of_expert_rows_and_every_forward_of_the_rest() -> None:
    from moebal.balance.experts import _profile_costs
    from moebal.config import load
    from moebal.distributed.groups import ParallelDims

    dims = ParallelDims(world_size=2, rank=0, ep=2, pp=1)
    base = ["planner.costs=a100", "data.batch_size=16", "data.seq_len=128"]
    _, one = _profile_costs(load(None, base), dims)
    _, four = _profile_costs(load(None, [*base, "train.grad_accum=4"]), dims)
    _, small = _profile_costs(load(None, ["planner.costs=a100", "data.batch_size=4", "data.seq_len=128"]), dims)
    assert four.expert_tokens_per_s == small.expert_tokens_per_s != one.expert_tokens_per_s
    assert four.nonmoe_fwd_s == pytest.approx(4 * small.nonmoe_fwd_s)
    assert four.nonmoe_bwd_s == pytest.approx(4 * small.nonmoe_bwd_s)


def test_the_trainers_profile_costs_send_the_bytes_of_the_runs_precision() -> None:
    """An fp32 run sends 4-byte tokens and experts: the planner must not price them as bf16 ones."""
    from moebal.balance.experts import _profile_costs
    from moebal.config import load
    from moebal.distributed.groups import ParallelDims

    dims = ParallelDims(world_size=2, rank=0, ep=2, pp=1)
    base = ["planner.costs=a100", "data.batch_size=16", "data.seq_len=128"]
    _, fp32 = _profile_costs(load(None, [*base, "train.precision=fp32"]), dims)
    _, bf16 = _profile_costs(load(None, [*base, "train.precision=bf16"]), dims)
    dim = load(None, base).model.dim
    assert (fp32.token_bytes, bf16.token_bytes) == (4 * dim, 2 * dim)
    assert fp32.expert_param_bytes == 2 * bf16.expert_param_bytes
