"""The pipeline's dynamism schemes under sharded state (`parallel.shard: optimizer` and `full`) against the
unsharded pipeline with the same scheme, on 4 gloo ranks (pp 2 x dp 2, 1F1B, clipping active): losses, gradient
norms and every final parameter within 1e-5 relative, over 5 steps with a forced migration after step 2 and one
inside step 4 (between its backward pass and its optimizer step: gradients travel). Every cell runs in one spawn;
each test checks its scheme's cells."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks
from tests.distributed.test_pipeline_sharded import _rel

STEPS = 5
MIGRATE = {"force": ((2, (1, 3)),), "force_mid": ((4, (3, 1)),)}
"""Layer 1 moves to the last stage after step 2; layers 1 and 2 come back inside step 4."""

SCHEMES: dict[str, dict[str, Any]] = {
    # prunes at steps 2 and 4 (70 %, then 80 % of the prunable weights), the CSR kernel inside FSDP2's units
    "pruning": {"kernel": "csr", "final_sparsity": 0.8, "start": 0, "every": 2, "steps": 2},
    # freezes layers 0 and 1 after step 2: the first stage is wholly frozen after the migration, then trains again
    "freezing": {"threshold": 10.0, "check_every": 2, "max_fraction": 0.5},
    # some tokens leave after layer 1, all after layer 2: subset and skipped layers, one rank's rows empty
    "early_exit": {"threshold": 0.9, "first_layer": 1},
    # routed layers 1 and 3 keep 2 of 16 tokens. Their top-k is discontinuous: a selection whose scores are within
    # rounding (gaps of 2e-10 seen) flips under the 1e-8 relative differences of sharded arithmetic (FSDP2's
    # per-micro-batch reduce-scatters, foreach AdamW), and capacities 0.25, 0.5, 0.75 flipped one in these 5 steps
    # (parameters 3e-4 to 7e-3 apart); 0.125 flips none
    "mod": {"capacity": 0.125, "every": 2, "first_layer": 1},
    "sparse_attention": {"block": 4, "budget": "random_walk"},
}
SHARDS = {"pruning": ("optimizer", "full"), "freezing": ("optimizer", "full"),
          "early_exit": ("optimizer", "full", "full+zb", "full+recompute"),
          "exit_whole": ("full+whole", "full+whole+zb"),
          "mod": ("optimizer", "full", "full+recompute"), "sparse_attention": ("optimizer", "full", "full+recompute"),
          "peers": ("optimizer", "full"), "mod_idle": ("optimizer", "full")}
"""The sharded runs of each scheme and case (below: "peers", "mod_idle", "exit_whole"; "+whole": `parallel.accumulate:
whole`; "+zb": the zero-bubble schedule, whose
W reduce-scatters the deferred Linear weight gradients, against the 1F1B reference; "+recompute": `train.recompute:
full`, whose backward replays the token-subset layers or the sparse attention inside their FSDP2 units, against the
reference without it)."""


PEERS = {"threshold": 0.97, "first_layer": 1}
"""Early exit where a rank's rows all leave before a layer its peer's rows still reach (one micro-batch: the
whole step's rows), for the unsharded pipeline's own gradient sum (`PipelineRunner._join_peers_grads`)."""
PEERS_SEED = 4
"""The peers runs' seed. With seed 0 one token's second and third gate logits on rank 1 were 3.0e-8 apart, the
sharded run's logits 4.5e-8 from the unsharded run's, and on an AVX-512 CPU its top-2 flipped at step 5 (layer 0's
router and experts 2.3e-4 apart after the step). Seed 4: a rank's rows all leave before layer 2 five times, and
no top-2 gap is under 3.5e-6, 70x the logits' differences."""
IDLE_MOD = {**SCHEMES["mod"], "start": 3}
"""MoD whose routers idle until step 3: they have no gradient in steps 1-2, which torch's AdamW skips (their step
count starts at step 3) and the sharded optimizer's flats must skip too (`ShardedAdamW(skips=True)`)."""
CASES = {"peers": ("early_exit", PEERS, 1, PEERS_SEED, ""), "mod_idle": ("mod", IDLE_MOD, 2, 0, ""),
         "exit_whole": ("early_exit", {"threshold": 0.97, "first_layer": 1}, 2, 0, "+dense")}
"""Cells beyond each scheme's own settings: (scheme, options, micro-batches, seed, what every run of the cell, the
unsharded one too, adds to its setting: "+dense", no MoE layer)."""
MIN_GAP = 1e-6
"""Smallest gap between a token's k-th and (k+1)-th gate scores that sharded rounding cannot flip."""


def scheme_cfg(shard: str, scheme: str, options: dict[str, Any] | None = None, micro_batches: int = 2,
               seed: int = 0) -> Config:
    shard, *extras = shard.split("+")
    return from_dict({
        "model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        "moe": {"num_experts": 0 if "dense" in extras else 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop",
                "aux_loss_coef": 0.01},
        "data": {"seq_len": 16, "batch_size": 8, "max_bytes": 200_000},
        "train": {"steps": STEPS, "warmup_steps": 2, "lr": 3e-3, "eval_every": 0, "precision": "fp32",
                  "grad_clip": 0.5, "threads": 1, "progress": "plain", "seed": seed,
                  "recompute": "full" if "recompute" in extras else "none"},
        "parallel": {"pp": 2, "ep": 1, "nproc": 4, "shard": shard,
                     "accumulate": "whole" if "whole" in extras else "sharded"},
        "pipeline": {"micro_batches": micro_batches, "schedule": "zb" if "zb" in extras else "1f1b"},
        "dynamism": {"scheme": scheme, scheme: options or SCHEMES[scheme]}})


def _run(shard: str, scheme: str, options: dict[str, Any] | None = None, micro_batches: int = 2,
         seed: int = 0) -> dict[str, Any]:
    import moebal.dynamism.early_exit as early_exit
    import moebal.routing.gate as gate
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.runner import PipelineRunner

    options = options or SCHEMES[scheme]
    cfg = scheme_cfg(shard, scheme, options, micro_batches, seed)
    ties: list[int] = []
    gaps: list[float] = [math.inf]
    tie, choice = early_exit._zero_tie, gate._choice_scores
    k = cfg.moe.top_k

    def counted(layer: Any, h: torch.Tensor) -> torch.Tensor:  # a rank with no token of a layer its peers run
        ties.append(1)
        return tie(layer, h)

    def gapped(*args: Any) -> tuple[torch.Tensor, ...]:  # the closest call of any token's top-k
        out = choice(*args)
        if out[0].shape[0]:
            top = out[0].detach().topk(k + 1, dim=-1).values
            gaps.append(float((top[:, k - 1] - top[:, k]).min()))
        return out

    early_exit._zero_tie = counted  # type: ignore[assignment]
    gate._choice_scores = gapped  # type: ignore[assignment]
    try:
        runner = PipelineRunner(cfg, scheme=build_dynamism(scheme, options, cfg=cfg), **MIGRATE)
        out = runner.train(STEPS)
    finally:
        early_exit._zero_tie = tie  # type: ignore[assignment]
        gate._choice_scores = choice  # type: ignore[assignment]
    opt = runner.optimizer
    return {"records": out.records, "sizes": out.final_sizes, "params": runner.full_state(), "ties": len(ties),
            "min_gap": min(gaps),
            "optimizer": type(opt).__name__,
            # a sharded optimizer rebuilt after a freeze holds only what trains
            "stale": 0 if opt is None else sum(not p.requires_grad for g in opt.param_groups for p in g["params"])}


def _cells(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for cell, shards in SHARDS.items():
        scheme, options, micro_batches, seed, extra = CASES.get(cell, (cell, None, 2, 0, ""))
        plain = _run("none" + extra, scheme, options, micro_batches, seed)
        ref = plain.pop("params")
        out[cell] = {"none": plain}
        for shard in shards:
            run = _run(shard + extra, scheme, options, micro_batches, seed)
            got = run.pop("params")
            assert got.keys() == ref.keys()
            run["param_rel"] = max(_rel(got[k], ref[k]) for k in ref if ref[k].norm() > 0)
            out[cell][shard] = run
    return out


@pytest.fixture(scope="module")
def cells() -> list[dict[str, Any]]:
    return run_ranks(_cells, 4, timeout_s=900)


def _check(cells: list[dict[str, Any]], scheme: str) -> list[dict[str, Any]]:
    """The parity of every sharded run of `scheme` (or of a CASES cell); returns the unsharded records (rank 0)."""
    # a token whose k-th and (k+1)-th gate scores are within rounding on any rank may route differently under
    # sharded arithmetic: a discontinuity of the model, not a parity bug; this says so instead of a parity miss
    gap = min(run["min_gap"] for r in cells for run in r[scheme].values())
    assert gap > MIN_GAP, (scheme, f"a top-k near-tie ({gap:.1e}): choose another seed")
    for r in cells:
        plain = r[scheme]["none"]
        for shard in SHARDS[scheme]:
            got = r[scheme][shard]
            assert got["optimizer"] in ("ShardedAdamW", "StageShardedAdamW", "NoneType"), got["optimizer"]
            assert [x["step"] for x in got["records"]] == list(range(1, STEPS + 1))
            for a, b in zip(plain["records"], got["records"]):
                assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (scheme, shard, a["step"], a["loss"],
                                                                         b["loss"])
                assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (scheme, shard, a["step"])
                assert a.get("migration") == b.get("migration") and a["sizes"] == b["sizes"]
            # a rank's missing gradient sum (the peers case) would leave a layer's update half its size
            assert got["param_rel"] < 1e-5, (scheme, shard, got["param_rel"])
            assert got["stale"] == 0, (scheme, shard)
        assert [x.get("migration") for x in plain["records"] if "migration" in x] == ["forced", "forced-mid"]
        assert any(x["grad_norm"] > 0.5 for x in plain["records"])  # the clip acted
    return list(cells[0][scheme]["none"]["records"])


def test_pruning_under_sharded_pipeline_state_matches_unsharded(cells):
    """Masks from the whole weights (FSDP2's gathered), applied to the shards' rows, the summed gradient shards
    and the moments' parts or rows; the CSR kernel inside FSDP2's units; masks migrate with their layer."""
    rec = _check(cells, "pruning")
    assert [x["sparsity_target"] for x in rec] == [0.0, 0.7, 0.7, 0.8, 0.8]


def test_freezing_under_sharded_pipeline_state_matches_unsharded(cells):
    """The sharded optimizers are rebuilt over what still trains; a wholly frozen first stage (no optimizer)
    sends its FSDP2-sharded layers whole."""
    rec = _check(cells, "freezing")
    assert [x["frozen_layers"] for x in rec] == [0, 2, 2, 2, 2]
    assert {r["freezing"]["full"]["optimizer"] for r in cells} == {"StageShardedAdamW"}


def test_early_exit_under_sharded_pipeline_state_matches_unsharded(cells):
    """Subset and skipped layers run as FSDP2 units' forwards; a rank whose rows no token of a layer reaches
    while its peers' do joins the unit's reduce-scatter with zero gradients (it happened), under 1F1B and under
    the zero-bubble schedule (its Linears' zero gradients deferred to W like its peers'). Under `optimizer` the
    last layer, which every rank skips, keeps its weights, moments and step count in that step, as torch's AdamW
    skips a parameter without a gradient (its flats stepped it before: parameters 4e-3 apart)."""
    rec = _check(cells, "early_exit")
    assert any(0 < x["survival"][2] < 1 for x in rec)  # layer 2 ran on a subset of the tokens
    assert rec[-1]["survival"][3] == 0.0  # every token left before the last layer: skipped on every rank
    assert all(sum(r["early_exit"][shard]["ties"] for r in cells) > 0
               for shard in SHARDS["early_exit"] if shard.startswith("full"))


def test_unsharded_pipeline_joins_a_peers_gradient_sum_for_a_layer_its_rows_all_left(cells):
    """A rank whose rows all left before a layer its data-parallel peer's rows reach has no gradient of it: it joins
    the stage's sum with zeros (the buckets paired one layer with another, or failed on their sizes, before), and
    matches the fully sharded run, whose zero ties (`_zero_tie`) show that the case happened, and the sharded
    optimizer's, which steps such a layer (a peer had a gradient) and skips one no rank's rows reach."""
    rec = _check(cells, "peers")
    assert any(0 < x["survival"][2] < 1 for x in rec)
    assert sum(r["peers"]["full"]["ties"] for r in cells) > 0


def test_early_exit_with_whole_gradient_sums_sends_the_sums_of_a_layer_the_last_micro_batch_skips(cells):
    """`parallel.accumulate: whole`, a dense model, threshold 0.97: in step 2 layer 3 runs in the first micro-batch
    and on no rank in the second, whose backward is the step's last and alone reduce-scatters FSDP2's whole sums;
    every rank then joins that backward with zeros (`EarlyExit.last_pass`), and the sums go out; under 1F1B and zero
    bubble (whose last W op sends them). Without it the layer's gradients stayed unsent (the gradient norm of step 2
    1.8e-4 apart). (An MoE layer's skip path runs its unit's forward anyway, so its sums go out either way.)"""
    rec = _check(cells, "exit_whole")
    assert 0 < rec[1]["survival"][3] < 1
    assert all(sum(r["exit_whole"][shard]["ties"] for r in cells) > 0 for shard in SHARDS["exit_whole"])


def test_mod_under_sharded_pipeline_state_matches_unsharded(cells):
    """The routed blocks (router, top-k, token subset) run as FSDP2 units' forwards; the router migrates with its
    layer (the skeletons a migration gathers into get it too)."""
    rec = _check(cells, "mod")
    assert all(x["mod_capacity"] == 0.125 for x in rec)


def test_mod_with_idle_routers_under_sharded_pipeline_state_matches_unsharded(cells):
    """The routers have no gradient until MoD starts at step 3 (torch's AdamW skips them; their first step count
    is 1 at step 3, their layers' 3): both sharded optimizers match, the routers' later steps included."""
    rec = _check(cells, "mod_idle")
    assert [x["mod_capacity"] for x in rec] == [1.0, 1.0, 0.125, 0.125, 0.125]


def test_sparse_attention_under_sharded_pipeline_state_matches_unsharded(cells):
    _check(cells, "sparse_attention")


@pytest.mark.parametrize("scheme, options", [("early_exit", {}), ("mod", {"start": 3}), ("mod", {"capacity": 1.0})])
def test_sharded_optimizer_takes_the_schemes_that_leave_parameters_without_a_gradient(scheme, options):
    cfg = {"parallel": {"pp": 2, "shard": "optimizer"}, "model": {"n_layers": 2},
           "dynamism": {"scheme": scheme, scheme: options}}
    assert from_dict(cfg).dynamism.scheme == scheme


def test_schemes_say_whether_a_step_may_leave_a_parameter_without_a_gradient():
    """The schemes that give a pipeline's sharded optimizer a step count per parameter (`skips`)."""
    from moebal.dynamism.scheme import build_dynamism

    cfg = scheme_cfg("full", "mod")
    idle = {(name, str(opts)): build_dynamism(name, opts, cfg=cfg).idle_parameters() for name, opts in [
        ("none", {}), ("pruning", {}), ("freezing", {}), ("sparse_attention", {"block": 4}), ("moe", {}),
        ("early_exit", {}), ("mod", {}), ("mod", {"start": 3}), ("mod", {"capacity": 1.0})]}
    assert [k for k, v in idle.items() if v] == [("early_exit", "{}"), ("mod", "{'start': 3}"),
                                                  ("mod", "{'capacity': 1.0}")]
