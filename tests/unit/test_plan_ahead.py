"""Plan-ahead (moebal/distributed/plan_ahead.py) in one process on hand-made routing: the device estimate equals
the profile's, the plan of layer i+1 follows the estimate made during layer i, the first l layers and a missing
profile fall back to the previous-iteration plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moebal.config import ConfigError, from_dict
from moebal.distributed.plan_ahead import SCALE, DevicePaths, PlanAhead, read_windows
from moebal.errors import CheckpointError
from moebal.planner.paths import build_profile
from moebal.planner.perf import MoELayerCosts
from moebal.planner.placement import plan_experts
from moebal.planner.plan import ExpertPlacement

E, R = 4, 2


def _routing() -> np.ndarray:
    """[L=3, T=8, K=1]: tokens that took expert 0 in layers 0 and 1 take expert 3 in layer 2 (owned by rank 1);
    tokens that took expert 1 then 1 take expert 0 in layer 2 (owned by rank 0)."""
    top1 = np.array([[0, 0, 0, 0, 1, 1, 1, 1],
                     [0, 0, 0, 0, 1, 1, 1, 1],
                     [3, 3, 3, 3, 0, 0, 0, 0]])
    return top1[:, :, None]


def test_device_estimate_equals_the_profile() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, E, size=(4, 64, 2))
    prof = build_profile([ids], num_experts=E, path_len=2)
    dev = DevicePaths(prof, torch.device("cpu"))
    batch = rng.integers(0, E, size=(4, 30, 2))
    batch[:, :3, 0] = E - 1  # some paths the profile may not hold: back-off
    top1 = [torch.as_tensor(batch[j, :, 0]) for j in range(4)]
    for layer in (1, 2, 3):
        want = prof.estimate(batch[:, :, 0].T, layer)
        got = dev.estimate(top1, layer).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for min_tokens in (3, 100):
        np.testing.assert_allclose(dev.estimate(top1, 3, min_tokens).numpy(),
                                   prof.estimate(batch[:, :, 0].T, 3, min_tokens=min_tokens), rtol=1e-12)
    # a profile of longer paths is cut to the planner's path length: it estimates as one built at that length
    longer = DevicePaths(build_profile([ids], num_experts=E, path_len=4), torch.device("cpu"), path_len=2)
    assert longer.path_len == 2 and max(len(t) for t in longer.tables) == 3
    for layer in (1, 2, 3):
        np.testing.assert_allclose(longer.estimate(top1, layer).numpy(), dev.estimate(top1, layer).numpy(),
                                   rtol=1e-12, atol=1e-12)
    # no integer matrix product on the device path: CUDA has none (int64 addmv is CPU-only)
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoIntegerMatmul(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.mv, torch.ops.aten.addmv, torch.ops.aten.bmm,
                                       torch.ops.aten.addmm, torch.ops.aten.dot):
                assert not any(isinstance(a, torch.Tensor) and not a.is_floating_point() for a in args), func
            return func(*args, **(kwargs or {}))

    with NoIntegerMatmul():
        np.testing.assert_allclose(dev.estimate(top1, 3).numpy(), prof.estimate(batch[:, :, 0].T, 3), rtol=1e-12)


def _costs() -> MoELayerCosts:
    """Expert compute dear, transfers cheap: a hot expert is worth replicating."""
    return MoELayerCosts(token_bytes=4, expert_param_bytes=4, expert_grad_bytes=4, expert_tokens_per_s=1e3,
                         a2a_bandwidth=1e12, trans_bandwidth=1e12, agg_bandwidth=1e12)


def _planner(log: list[tuple[int, np.ndarray]]):
    def plan(j: int, est_RE: np.ndarray) -> ExpertPlacement:
        log.append((j, est_RE))
        return plan_experts(est_RE, "prophet", _costs())
    return plan


def test_plan_for_the_next_layer_follows_the_estimate() -> None:
    prof = build_profile([_routing()], num_experts=E, path_len=2)
    log: list[tuple[int, np.ndarray]] = []
    ahead = PlanAhead(3, E, 2, _planner(log), torch.device("cpu"), prof)
    assert ahead.ahead_layers() == [2]  # layers 0, 1 (< l): previous-iteration plan
    issued: dict[int, ExpertPlacement] = {}
    assert ahead.arm(lambda j, p: issued.__setitem__(j, p)) == [2]
    # this rank's 6 tokens: paths (0, 0) -> all of layer 2's load on expert 3
    ids0 = torch.tensor([[0]] * 6)
    assert ahead.on_gate(0, ids0) is None  # layer 1 is not planned ahead
    est = ahead.on_gate(1, ids0)
    assert est is not None and est.tolist() == [0, 0, 0, 6 * SCALE]
    # the count exchange: rank 0 sends its estimate, rank 1 (paths (1, 1)) predicts 2 tokens for expert 0
    ahead.on_counts(1, [est.tolist(), [2 * SCALE, 0, 0, 0]])
    j, est_RE = log[-1]
    assert j == 2
    np.testing.assert_array_equal(est_RE, [[0, 0, 0, 6], [2, 0, 0, 0]])
    plc = issued[2]
    assert plc is ahead.placed[2]
    assert 0 in plc.replicas[3]  # the hot expert of the estimate (owned by rank 1) is replicated on rank 0
    assert plc == plan_experts(np.array([[0, 0, 0, 6], [2, 0, 0, 0]]), "prophet", _costs())
    assert 1 in plc.replicas[0]  # rank 1's predicted rows of expert 0 (owned by rank 0) stay on rank 1
    assert plc != plan_experts(np.ones((R, E)), "prophet", _costs())  # not what a balanced forecast gives
    assert ahead.pending == set()
    # a second forward of the step plans nothing more
    assert ahead.on_gate(0, ids0) is None and ahead.on_gate(1, ids0) is None
    # accuracy of the plan's estimate against the real counts and the previous-iteration forecast
    counts = {2: np.array([[0, 0, 0, 6], [2, 0, 0, 0]], dtype=float)}
    prev = {2: np.array([[1, 1, 1, 1], [1, 1, 1, 1]], dtype=float)}
    acc = ahead.accuracy(counts, prev, top_n=2)
    assert acc["path_overlap"] == 1.0 and acc["path_rel_mae"] == 0.0
    assert acc["prev_overlap"] == 0.5 and acc["prev_rel_mae"] == 1.0  # uniform: ties take experts 0, 1


def test_static_arm_plans_nothing_and_mismatched_profile_is_refused() -> None:
    prof = build_profile([_routing()], num_experts=E, path_len=2)
    ahead = PlanAhead(3, E, 2, _planner([]), torch.device("cpu"), prof)
    assert ahead.arm(None) == []
    assert ahead.on_gate(1, torch.tensor([[0]] * 4)) is None
    with pytest.raises(ValueError, match="describes 3 MoE layers"):
        PlanAhead(4, E, 2, _planner([]), torch.device("cpu"), prof)
    with pytest.raises(ValueError, match="--path-len 3"):
        PlanAhead(3, E, 3, _planner([]), torch.device("cpu"), prof)


def test_online_profile_starts_empty_then_builds_from_the_run() -> None:
    log: list[tuple[int, np.ndarray]] = []
    ahead = PlanAhead(3, E, 1, _planner(log), torch.device("cpu"), None, refresh=2, window=4)
    ids = torch.as_tensor(_routing())
    for _ in range(2):
        assert ahead.ahead_layers() == []  # no profile yet: every layer keeps the previous-iteration plan
        assert ahead.arm(lambda j, p: None) == []
        for i in range(3):
            assert ahead.on_gate(i, ids[i]) is None
        ahead.end_step()
    assert len(ahead.samples) == 2
    assert ahead.ahead_layers() == [1, 2]  # l = 1: layer 1 from layer 0's expert
    ahead.arm(lambda j, p: None)
    est = ahead.on_gate(0, ids[0])
    assert est is not None and est.tolist() == [4 * SCALE, 4 * SCALE, 0, 0]
    ahead.on_counts(0, [est.tolist(), est.tolist()])
    assert log[-1][0] == 1
    est = ahead.on_gate(1, ids[1])
    assert est is not None and est.tolist() == [4 * SCALE, 0, 0, 4 * SCALE]


def test_config_refusals(tmp_path) -> None:
    base = {"moe": {"num_experts": 4}, "planner": {"plan_ahead": "path"}}
    assert from_dict(base).planner.plan_ahead == "path"
    for bad, match in (({"path_len": 0}, "path_len"), ({"path_refresh": 5, "path_window": 2}, "path_window"),
                       ({"policy": "static"}, "policy static"),
                       ({"path_profile": str(tmp_path / "none.npz")}, "is not a file")):
        with pytest.raises(ConfigError, match=match):
            from_dict({**base, "planner": {**base["planner"], **bad}})
    with pytest.raises(ConfigError, match="token subsets"):
        from_dict({**base, "dynamism": {"scheme": "mod"}})
    # a path as long as the MoE layers leaves no layer to plan ahead (it once ran, planning nothing)
    with pytest.raises(ConfigError, match="set planner.path_len below 4"):
        from_dict({**base, "planner": {**base["planner"], "path_len": 4}})
    # inside pipeline stages: with expert parallelism, not without it; token-subset schemes still refused
    stages = {**base, "parallel": {"pp": 2, "ep": 2, "nproc": 4}}
    assert from_dict(stages).planner.plan_ahead == "path"
    with pytest.raises(ConfigError, match="no expert-parallel group"):
        from_dict({**base, "parallel": {"pp": 2, "ep": 1, "nproc": 2}})
    for scheme in ("mod", "early_exit"):
        with pytest.raises(ConfigError, match="token subsets"):
            from_dict({**stages, "dynamism": {"scheme": scheme}})
    with pytest.raises(ConfigError, match="policy static"):
        from_dict({**stages, "planner": {**base["planner"], "policy": "static"}})


def test_a_stage_profile_keeps_the_paths_inside_its_layers() -> None:
    """`PathProfile.layers`: a pipeline stage's slice estimates its layers as the whole profile does wherever
    the path lies inside the stage, and never reaches a layer before it."""
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, 4, size=(5, 64, 2)) for _ in range(3)]
    whole = build_profile(samples, 4, path_len=2)
    part = whole.layers(2, 5)
    assert part.num_layers == 3 and len(part.tables[0]) == 1  # the stage's first layer: its marginal alone
    assert [len(t) for t in part.tables] == [1, 2, 3]  # local layer k: paths of length 0 .. min(l, k)
    paths_TL = samples[0][:, :, 0].T
    for k in (2,):  # a full path inside the stage: the same estimate as the whole profile's
        np.testing.assert_array_equal(part.estimate(paths_TL[:, 2:], k), whole.estimate(paths_TL, 2 + k))
    assert whole.layers(1, 1).num_layers == 0
    with pytest.raises(ValueError, match="MoE layers 0..4"):
        whole.layers(3, 6)


def test_the_step_scale_multiplies_the_estimate() -> None:
    """A pipeline stage plans from its first micro-batch's estimate times the step's tokens over that
    micro-batch's: the estimate sent is scaled, the plan sees the step's counts."""
    profile = build_profile([np.array([[[0, 1]] * 4, [[2, 3]] * 4])], 4, path_len=1)
    ahead = PlanAhead(2, 4, 1, lambda j, est: ExpertPlacement.static(4, 2), torch.device("cpu"), profile)
    ahead.arm(lambda j, p: None)
    ahead.set_step_scale(2.5)
    ids = torch.tensor([[0, 1]] * 4)
    est = ahead.on_gate(0, ids)
    assert est is not None and est.tolist() == [0, 0, 10 * SCALE, 10 * SCALE]
    with pytest.raises(ValueError, match="positive"):
        ahead.set_step_scale(0.0)


def test_a_profile_recorded_at_another_top_k_is_scaled_to_the_model_s() -> None:
    """A top-1 profile on a top-2 model: its distributions sum to 1 per token, the model routes 2, so the
    estimate is doubled (it planned from half the assignments); a profile at the model's own k is not scaled."""
    top1 = build_profile([np.array([[[0]] * 4, [[2]] * 4])], 4, path_len=1)
    top2 = build_profile([np.array([[[0, 1]] * 4, [[2, 3]] * 4])], 4, path_len=1)
    for profile, want in ((top1, [0, 0, 8 * SCALE, 0]), (top2, [0, 0, 4 * SCALE, 4 * SCALE])):
        ahead = PlanAhead(2, 4, 1, lambda j, est: ExpertPlacement.static(4, 2), torch.device("cpu"), profile,
                          top_k=2)
        ahead.arm(lambda j, p: None)
        est = ahead.on_gate(0, torch.tensor([[0, 1]] * 4))
        assert est is not None and est.tolist() == want and int(est.sum()) == 4 * 2 * SCALE


class _Reader:
    """A checkpoint's extra tensors in memory (what `read_windows` asks of a CheckpointReader)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.path, self.tensors = Path("ckpt-test"), tensors

    def extra_names(self) -> list[str]:
        return sorted(self.tensors)

    def read_extra(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _steps(ahead: PlanAhead, routing: list[np.ndarray], first: int = 0) -> list[tuple[list[int], list[list[int]]]]:
    """Run plan-ahead's side of steps on `routing` ([L_model, T, K] per step, this planner's layers from
    `first`): per step the ahead layers and the estimates it made."""
    out = []
    for ids in routing:
        ahead.arm(lambda j, p: None)
        ests = []
        for i in range(ahead.L):
            est = ahead.on_gate(i, torch.as_tensor(ids[first + i]))
            if est is not None:
                ests.append(est.tolist())
                ahead.on_counts(i, [est.tolist(), est.tolist()])
        out.append((sorted(ahead.placed), ests))
        ahead.end_step()
    return out


def _online(layers: int = 3, refresh: int = 3, window: int = 4) -> PlanAhead:
    return PlanAhead(layers, E, 1, _planner([]), torch.device("cpu"), None, refresh=refresh, window=window)


def _random_routing(steps: int, layers: int = 3, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, E, size=(layers, int(rng.integers(6, 12)), 2)) for _ in range(steps)]


@pytest.mark.parametrize("cut", [1, 3, 4, 9, 11])
def test_a_saved_window_continues_the_online_profile_exactly(cut: int) -> None:
    """Saved after `cut` steps (before the first build, on a build, between builds, with the window already
    trimmed) and loaded into a fresh planner, the profile plans the following steps as the uninterrupted one:
    the same ahead layers and estimates, the same samples, counter and builds."""
    routing = _random_routing(16)
    whole = _online()
    _steps(whole, routing[:cut])
    saved = whole.window_tensors(0, 1, 2)
    assert sorted(saved) == [f"plan_ahead.shard1.moe{j}.{k}" for j in range(3) for k in ("ids", "meta")]
    windows = read_windows(_Reader(saved), 1)
    resumed = _online()
    assert resumed.window_misfit(windows, 0, 2) is None
    resumed.load_window(windows, 0)
    assert (resumed.steps, resumed.fresh, len(resumed.samples)) == (whole.steps, whole.fresh, len(whole.samples))
    assert (resumed.paths is None) == (whole.paths is None) == (cut < 3)
    assert _steps(resumed, routing[cut:]) == _steps(whole, routing[cut:])
    assert all(np.array_equal(a, b) for a, b in zip(resumed.samples, whole.samples))


def test_the_windows_are_per_moe_layer_so_a_new_partition_takes_the_layers_it_holds() -> None:
    """Two stages' windows (layers 0-1 and 2-3, saved over the same steps) continue a stage of layers 1-2 as if
    it had held them from the start; windows of other token shards, missing layers or other steps do not fit,
    and say why."""
    routing = _random_routing(5, layers=4)
    stages = [_online(2), _online(2)]
    _steps(stages[0], routing, first=0)
    _steps(stages[1], routing, first=2)
    windows = read_windows(_Reader({**stages[0].window_tensors(0, 0, 2), **stages[1].window_tensors(2, 0, 2)}), 0)
    assert sorted(windows) == [0, 1, 2, 3]
    middle, reference = _online(2), _online(2)
    _steps(reference, routing, first=1)
    assert middle.window_misfit(windows, 1, 2) is None
    middle.load_window(windows, 1)
    later = _random_routing(4, layers=4, seed=1)
    assert _steps(middle, later, first=1) == _steps(reference, later, first=1)
    assert "token shards" in str(_online(2).window_misfit(windows, 1, 4))  # another dp x ep size
    assert "no online path profile of MoE layer 4" in str(_online(2).window_misfit(windows, 3, 2))
    restarted = _online(2)  # a migration restarted this stage's profile after step 3
    _steps(restarted, routing[3:], first=2)
    mixed = read_windows(_Reader({**stages[0].window_tensors(0, 0, 2), **restarted.window_tensors(2, 0, 2)}), 0)
    assert "different steps" in str(_online(2).window_misfit(mixed, 1, 2))
    bad = stages[0].window_tensors(0, 0, 2)
    bad["plan_ahead.shard0.moe0.meta"] = bad["plan_ahead.shard0.moe0.meta"][:5]
    with pytest.raises(CheckpointError, match="malformed"):
        read_windows(_Reader(bad), 0)


def test_a_loaded_profile_saves_nothing() -> None:
    ahead = PlanAhead(3, E, 2, _planner([]), torch.device("cpu"), build_profile([_routing()], E, path_len=2))
    assert ahead.window_tensors(0, 0, 1) == {}


def test_a_pipeline_stage_without_expert_parallelism_refuses_plan_ahead() -> None:
    """With neither parallel.ep nor parallel.nproc set the config check cannot see a stage's expert-parallel
    size; the stage refuses at start-up, naming it, instead of planning nothing."""
    from moebal.balance.experts import StageExperts
    from moebal.distributed.groups import ParallelDims

    cfg = from_dict({"moe": {"num_experts": 4}, "planner": {"plan_ahead": "path"}, "parallel": {"pp": 2}})
    with pytest.raises(ConfigError, match=r"resolved to 1: 2 ranks over parallel.pp 2 stages"):
        StageExperts(None, ParallelDims(world_size=2, rank=0, pp=2, ep=1), cfg)  # type: ignore[arg-type]


def test_plan_ahead_without_expert_parallel_ranks_is_refused_not_idle() -> None:
    """One process, or parallel.ep 1, has no expert-parallel group: plan-ahead would plan nothing, so the config
    check refuses what it can see (parallel.nproc 1, parallel.ep 1) and the start-up check the rest."""
    from moebal.balance.experts import refuse_idle_plan_ahead

    base = {"moe": {"num_experts": 4}, "planner": {"plan_ahead": "path"}}
    for par, match in (({"nproc": 1}, "parallel.nproc 1"), ({"nproc": 4, "ep": 1}, "parallel.ep 1")):
        with pytest.raises(ConfigError, match=match):
            from_dict({**base, "parallel": par})
    cfg = from_dict(base)  # nproc and ep unset: known only at start-up
    with pytest.raises(ConfigError, match=r"one process.*--nproc 2"):
        refuse_idle_plan_ahead(cfg, ep=1, world_size=1)
    with pytest.raises(ConfigError, match="expert-parallel size is 1"):
        refuse_idle_plan_ahead(cfg, ep=1, world_size=2)
    refuse_idle_plan_ahead(cfg, ep=2, world_size=2)
    refuse_idle_plan_ahead(from_dict({"moe": {"num_experts": 4}}), ep=1, world_size=1)  # plan-ahead off


def test_one_process_training_refuses_plan_ahead(tmp_path) -> None:
    """`--nproc 1` is refused by the config check; a one-rank torchrun job (RANK set, WORLD_SIZE 1), whose size the
    config cannot see, by the trainer's start-up check."""
    from tests.cli_util import run_cli

    model = ("model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "moe.num_experts=4",
             "planner.plan_ahead=path", "planner.path_len=1")
    r = run_cli("train", "--steps", "1", "--nproc", "1", "--out", str(tmp_path / "a"), *model)
    assert r.returncode != 0 and "parallel.nproc 1 (one process)" in r.stderr and "plan_ahead off" in r.stderr
    r = run_cli("train", "--steps", "1", "--out", str(tmp_path / "b"), *model, env={"RANK": "0", "WORLD_SIZE": "1"})
    assert r.returncode != 0 and "this run is one process" in r.stderr and "plan_ahead off" in r.stderr
    assert not (tmp_path / "b" / "ckpt").exists()
