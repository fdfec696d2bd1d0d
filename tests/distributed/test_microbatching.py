"""Planned micro-batching on real gloo ranks: variable-size micro-batches (DynaPipe), padding to the batch
maximum, planned communication and planning ahead give the same loss per token and the same parameters as
the same samples trained in one batch by one process."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks
from moebal.models import padding

from .test_pipeline import _merge, reference_losses


def write_samples(path: str, n: int = 400, seed: int = 0) -> str:
    """A .jsonl corpus, one sample per line, log-normal lengths (median 12 bytes, a tail to 64)."""
    rng = np.random.default_rng(seed)
    words = ["def", "x", "return", "(", ")", "self", "=", "+", "if", ":", "\n", "    "]
    with open(path, "w", encoding="utf-8") as f:
        for n_bytes in np.clip(rng.lognormal(np.log(12), 0.9, n), 2, 64).astype(int):
            text = "".join(rng.choice(words, size=int(n_bytes)))[:int(n_bytes)]
            f.write(json.dumps({"text": text}) + "\n")
    return path


SAMPLES: dict[str, str] = {}

PRUNING = {"start": 2, "every": 2, "steps": 2, "final_sparsity": 0.8, "kernel": "dense"}
FREEZING = {"threshold": 10.0, "check_every": 2, "max_fraction": 0.5, "start": 2}
"""Every layer's plasticity is below 10: the first two layers (stage 0's) freeze at step 2's check."""
EARLY_EXIT = {"threshold": 0.9, "first_layer": 1, "start": 2, "ramp_steps": 1}
"""Most tokens leave after layer 1 from step 2: the active mask crosses the stage boundary with the activations."""
MOD = {"capacity": 0.5, "every": 2, "first_layer": 1, "start": 2}
"""Layers 1 and 3 route half of each row's real tokens from step 2."""
SPARSE = {"budget": "random_walk", "block": 4, "min_density": 0.05, "walk_step": 0.5, "start": 1, "costs": "given"}
"""Blocks of 4 tokens: whole blocks in every micro-batch, which pads to a multiple of 8 (`pad_multiple`)."""


def docs(pp: int = 2, nproc: int | None = None, method: str = "dynamic", moe: int = 0, ep: int | None = None,
         aux: float = 0.01, z: float = 0.0, **dynamic: object) -> Config:
    """A tiny model on variable-length samples (one per .jsonl line): long-tailed lengths. `ep` null: an MoE
    model's experts are sharded over every rank of a stage; `aux`, `z`: the MoE routing losses' coefficients."""
    return from_dict({
        "model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 64},
        "moe": {"num_experts": moe, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop", "aux_loss_coef": aux,
                "z_loss_coef": z},
        "data": {"source": SAMPLES["path"], "seq_len": 64, "batch_size": 12, "samples": "documents",
                 "val_fraction": 0.0},
        "train": {"steps": 3, "warmup_steps": 0, "lr": 1e-2, "eval_every": 0, "precision": "fp32"},
        "parallel": {"pp": pp, "nproc": nproc or pp, "ep": ep},
        "planner": {"costs": "rtx3090"},  # a fixed profile: runs compared bit for bit plan the same placements
        "pipeline": {"microbatching": method,
                     "dynamic": {"costs": "a100", "max_tokens": 192, "workers": 0, **dynamic}}})


def _train(cfg: Config, steps: int, scheme: str = "none", options: dict | None = None, **knobs: object) -> dict:
    """The losses of `steps` steps, the first step's gradients (summed over replicas, before clipping), each
    step's plan and what this rank ran of it (its replica, part, stage, instruction stream and rows); `scheme`:
    the dynamism scheme the runner applies, with `options`; `knobs`: the runner's (`force`: forced partitions)."""
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.planned import PlannedPipelineRunner

    class Capture(PlannedPipelineRunner):
        grads: dict = {}
        plans: list = []
        ran: list = []
        routing: list = []

        def _gather_routing(self, step: int) -> None:
            super()._gather_routing(step)
            sample = self.take_routing_sample()
            if sample is not None:
                self.routing.append(sample.numpy())

        def _sync_grads(self) -> None:
            super()._sync_grads()
            if self.step == 1:
                self.grads = {k: p.grad.numpy().copy() for k, p in self.stage.named_parameters()
                              if p.grad is not None}

        def _run_engine(self, work, count):
            plan, ls = work[0], self.lockstep
            rep = plan.replicas[ls.replica]
            self.plans.append(plan.to_dict())
            self.ran.append({"replica": ls.replica, "part": ls.part, "stage": self.chain.index,
                             "stream": rep.streams[self.chain.index],
                             "rows": [plan.micro_batches[g].part(ls.part, plan.lockstep) for g in rep.micro_batches]})
            return super()._run_engine(work, count)

    runner = Capture(cfg, scheme=build_dynamism(scheme, options or {}, cfg=cfg), **knobs)
    out = runner.train(steps)
    ahead = runner.experts.ahead
    return {"losses": [r["loss"] for r in out.records], "aux": [r["aux_loss"] for r in out.records],
            "records": out.records, "grads": runner.grads, "plans": runner.plans, "ran": runner.ran,
            "routing": runner.routing,
            "ahead_scale": None if ahead is None else ahead.scale}


def planned_reference(cfg: Config, plans: list[dict]) -> dict:
    """One process replays a planned run: per step, every micro-batch of the plan in turn (all its rows, every
    replica's), its summed token cross-entropy over the batch's label count plus its auxiliary loss weighted by
    its share of the batch's tokens; clip, AdamW. The losses, auxiliary losses and first step's gradients, and
    per step the top-k expert ids [MoE layers, tokens, K] of the real tokens of replica 0's micro-batch that every
    stage forwards last (what `train.record_routing_every` records)."""
    from moebal.data import build_data
    from moebal.models import build_model
    from moebal.pipeline.planned import micro_batch_tensors
    from moebal.planner.microbatch import MicroBatchPlan
    from moebal.train.optim import build_optimizer, lr_at
    from moebal.train.trainer import seed_everything

    data = build_data(cfg)
    seed_everything(cfg.train.seed)
    model = build_model(cfg)
    opt = build_optimizer(model, cfg.train)
    out: dict = {"losses": [], "aux": [], "grads": {}, "routing": []}
    for s, raw in enumerate(plans):
        plan = MicroBatchPlan.from_dict(raw)
        rep = plan.replicas[0]
        last = rep.micro_batches[[j for op, j in rep.streams[0] if op == "F"][-1]]
        samples = data.train.next_samples()
        count = sum(len(x) - 1 for x in samples)
        for g in opt.param_groups:
            g["lr"] = lr_at(s, cfg.train)
        loss = aux = 0.0
        for mb in plan.micro_batches:
            ids, labels = micro_batch_tensors(samples, mb)
            res = model(ids, labels, padding.rows_of_labels(labels))  # the MoE losses without the padding
            part = res.loss * int((labels != -100).sum()) / count
            weighted = res.aux_loss * mb.tokens / count
            (part + weighted).backward()
            loss, aux = loss + part.item(), aux + weighted.item()
            if mb is plan.micro_batches[last] and cfg.moe.num_experts:
                ids = torch.stack([layer.last_routing.indices_TK for layer in model.moe_layers()])
                out["routing"].append(ids[:, (labels != -100).reshape(-1)].numpy())
        out["losses"].append(loss)
        out["aux"].append(aux)
        if s == 0:
            out["grads"] = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
    return out


def reference_grads(cfg: Config) -> dict[str, torch.Tensor]:
    """Gradients of the mean token loss of the first batch, all samples in one padded batch, one process."""
    from moebal.data import build_data
    from moebal.models import build_model
    from moebal.train.trainer import seed_everything

    seed_everything(cfg.train.seed)
    model = build_model(cfg)
    batch = build_data(cfg).train.next_batch()
    out = model(batch.ids_BT, batch.labels_BT, padding.rows_of_labels(batch.labels_BT))
    (out.loss + out.aux_loss).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _fixed(cfg: Config, steps: int, scheme: str, options: dict) -> dict:
    """`steps` steps under `pipeline.microbatching: fixed` (the engine cuts each padded batch into equal parts),
    then the validation sums of one padded batch and of its rows run alone, unpadded."""
    from moebal.data.loader import Batch
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.runner import PipelineRunner

    runner = PipelineRunner(cfg, scheme=build_dynamism(scheme, options, cfg=cfg))
    out = runner.train(steps)
    batch = runner.data.train.next_batch()
    n_B = (batch.labels_BT != -100).sum(dim=1).tolist()
    rows = [Batch(batch.ids_BT[b:b + 1, :n], batch.labels_BT[b:b + 1, :n], n) for b, n in enumerate(n_B)]
    return {"losses": [r["loss"] for r in out.records], "padded_rows": sum(n < batch.ids_BT.shape[1] for n in n_B),
            "eval_batch": runner.evaluate([batch]), "eval_rows": runner.evaluate(rows)}


def _two_ranks(rank: int, world: int, path: str) -> dict:
    SAMPLES["path"] = path
    return {
        "dynamic": _train(docs(), 3),                                   # both schedules simulated, the faster run
        "adaptive": _train(docs(schedules="adaptive", workers=1), 3),   # in a background planning process
        "one_f_one_b": _train(docs(schedules="1f1b"), 3),
        "padding": _train(docs(method="padding"), 3),
        "moe": _train(_recording(docs(moe=4)), 4),  # a routing sample every step
        # the MoE routing cost observed on planned micro-batches, costed for 2 expert shards (ep 1 computes every
        # row on one rank: a cost that routing never changes)
        "moe_scheme": _train(docs(moe=4), 4, "moe", {"ep_size": 2}),
        # schemes that change only what a layer computes: pruning from step 4 (masked dense kernel: bitwise
        # reproducible), sparse attention from step 2; each also with layers 0 | 1-3 forced after step 2
        **{name: _train(docs(), 6, scheme, options, force=force)
           for scheme, options in (("pruning", PRUNING), ("sparse_attention", SPARSE), ("freezing", FREEZING),
                                   ("early_exit", EARLY_EXIT), ("mod", MOD))
           for name, force in ((scheme, ()), (f"{scheme}_forced", ((2, (1, 3)),)))},
        # MoD on micro-batches padded otherwise: each row keeps the share of its real tokens
        "mod_padding": _train(docs(method="padding"), 6, "mod", MOD),
        # ... and under fixed micro-batching, the engine's equal parts of each padded batch
        "mod_fixed": _fixed(docs(method="fixed"), 6, "mod", MOD),
    }


def _four_ranks(rank: int, world: int, path: str) -> dict:
    import torch.distributed as dist

    SAMPLES["path"] = path
    out = {"dp": _train(docs(nproc=4), 3)}  # 2 stages x 2 data-parallel pipelines, Karmarkar-Karp
    # 4 stages of one layer, re-packed onto 2 after step 2 (ranks 1 and 2 released), plans drawn 2 steps ahead
    out["repack"] = _train(docs(pp=4, nproc=4, workers=1), 5, force=((2, (2, 2)),))
    dist.barrier()  # the released ranks wait here for the others
    return out


def _lockstep_ranks(rank: int, world: int, path: str) -> dict:
    SAMPLES["path"] = path
    # 2 stages x 2 expert shards, routing losses: the stage's two ranks run every micro-batch together
    return {"ep": _train(docs(nproc=4, moe=4, ep=2, z=1e-3, max_tokens=96), 3),
            # no routing loss: lockstep for the all-to-alls only
            "ep_no_losses": _train(docs(nproc=4, moe=4, ep=2, aux=0.0, max_tokens=96), 3),
            # 2 data-parallel pipelines summing routing losses
            "dp_moe": _train(docs(nproc=4, moe=4, ep=1, max_tokens=96), 3),
            # the first run with placement planned ahead of the gate (planner.plan_ahead) inside the stages
            "ep_ahead": _train(_plan_ahead(docs(nproc=4, moe=4, ep=2, z=1e-3, max_tokens=96)), 3),
            # the schemes whose state crosses the boundary (early exit's mask) or stops gradients at it (freezing),
            # on expert-parallel stages in lockstep
            **{f"ep_{scheme}": _train(docs(nproc=4, moe=4, ep=2, z=1e-3, max_tokens=96), 4, scheme, options)
               for scheme, options in (("early_exit", EARLY_EXIT), ("freezing", FREEZING), ("pruning", PRUNING),
                                       ("sparse_attention", SPARSE), ("mod", MOD))}}


def _recording(cfg: Config) -> Config:
    """`cfg` recording a routing sample every step (`train.record_routing_every`)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, record_routing_every=1))


def _plan_ahead(cfg: Config) -> Config:
    """`cfg` with Pro-Prophet placement on a fixed hardware profile and each stage's second MoE layer planned
    during its first from an online path profile built after every step."""
    planner = dataclasses.replace(cfg.planner, policy="prophet", costs="rtx3090", hysteresis=0.0,
                                  plan_ahead="path", path_len=1, path_refresh=1, path_window=2)
    return dataclasses.replace(cfg, planner=planner)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    SAMPLES["path"] = write_samples(str(tmp_path_factory.mktemp("samples") / "samples.jsonl"))
    return SAMPLES["path"]


@pytest.fixture(scope="module")
def two(corpus: str) -> list[dict]:
    return run_ranks(_two_ranks, 2, corpus)


def _check(results: list[dict], case: str, ref: list[float], ref_grads: dict[str, torch.Tensor],
           replicas: int = 1) -> None:
    got = results[0][case]["losses"]
    assert all(r[case]["losses"] == got for r in results), case  # every rank reports the same loss
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got, ref)), (case, got, ref)
    grads = _merge([r[case]["grads"] for r in results])
    assert set(grads) == set(ref_grads)
    for k, v in ref_grads.items():
        # fp32 sums in another order: equal to ~1e-7 of the gradient's scale
        torch.testing.assert_close(grads[k], v, rtol=1e-4, atol=1e-6 * float(v.abs().max()), msg=f"{case}: {k}")


def test_dynamic_micro_batches_give_the_one_batch_loss_per_token(two):
    ref, _ = reference_losses(docs(), 3)
    ref_grads = reference_grads(docs())
    for case in ("dynamic", "adaptive", "one_f_one_b", "padding"):
        _check(two, case, ref, ref_grads)
    recs = {case: two[0][case]["records"] for case in ("dynamic", "adaptive", "one_f_one_b", "padding")}
    assert {r["schedule"] for r in recs["adaptive"]} == {"adaptive"}
    assert {r["schedule"] for r in recs["one_f_one_b"]} == {"1f1b"}
    dyn, pad = recs["dynamic"], recs["padding"]
    assert all(r["micro_batches"] >= 2 for r in dyn)  # variable sizes: not one micro-batch, not one per sample
    eff = sum(r["tokens"] for r in dyn) / sum(r["computed_tokens"] for r in dyn)
    assert eff > sum(r["tokens"] for r in pad) / sum(r["computed_tokens"] for r in pad)
    moe_ref, _ = reference_losses(docs(moe=4), 2)
    got = two[0]["moe"]["losses"]
    assert math.isclose(got[0], moe_ref[0], rel_tol=1e-5)  # first step: the same cross-entropy
    assert all(np.isfinite(got))


def test_routing_samples_of_planned_micro_batches_are_the_real_tokens_of_the_last_one(two):
    """`train.record_routing_every` on planned micro-batches (2 stages): each step's sample is every MoE layer's
    expert ids of the real tokens (no padding) of the micro-batch both stages forward last, gathered along the
    chain: equal to the one-process replay of the same plans."""
    from moebal.planner.microbatch import MicroBatchPlan

    run = two[0]["moe"]
    ref = planned_reference(docs(moe=4), run["plans"])
    assert len(run["routing"]) == len(ref["routing"]) == 4
    padded = 0
    for step, (got, want, raw) in enumerate(zip(run["routing"], ref["routing"], run["plans"], strict=True), 1):
        assert got.shape[0] == 4 and got.shape[2] == 2, got.shape  # 4 MoE layers in model order, top-2
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        plan = MicroBatchPlan.from_dict(raw)
        rep = plan.replicas[0]
        last = plan.micro_batches[rep.micro_batches[[j for op, j in rep.streams[1] if op == "F"][-1]]]
        assert got.shape[1] == last.tokens <= len(last.rows) * last.seq
        padded += last.tokens < len(last.rows) * last.seq
    assert padded  # some of the last micro-batches were padded: their padding is not in the sample
    assert two[1]["moe"]["routing"] == []  # recorded on the chain's first stage of the first data rank


def test_the_moe_scheme_on_planned_micro_batches_keeps_the_losses(two):
    """`--dynamism moe` with planned micro-batches at ep 1 (2 stages, layer balancer off): the scheme observes
    each MoE layer's routing cost (modelled for 2 expert shards) and changes nothing: the losses of the same run
    without it, bit for bit."""
    plain, scheme = two[0]["moe"], two[0]["moe_scheme"]
    assert len(scheme["losses"]) == 4 and scheme["losses"] == plain["losses"]
    assert all(r["moe"]["losses"] == r["moe_scheme"]["losses"] for r in two)
    assert [r["micro_batches"] for r in scheme["records"]] == [r["micro_batches"] for r in plain["records"]]
    costs = [r["predicted_cost"] for r in scheme["records"]]
    assert all(len(c) == 4 for c in costs) and max(max(c) for c in costs) > 1.0  # routing imbalance is seen


@pytest.mark.parametrize("scheme", ["pruning", "sparse_attention", "freezing", "early_exit", "mod"])
def test_dynamism_schemes_run_on_planned_micro_batches(two, scheme):
    """Every scheme on planned micro-batches (2 stages, 6 steps): the losses of the same planned run without the
    scheme until the scheme acts, every rank reports the same, the scheme acts (layer densities below 1; stage 0
    frozen whole, so no gradient crosses the boundary; tokens left before the last layers, their mask carried
    across the boundary, counted without padding; MoD's capacity below 1), and a forced migration after step 2
    keeps the losses to 1e-6 (after a migration the micro-batch planner re-costs its plans on the new partition
    and may split the same samples otherwise, as in the other planned rebalancing cells). Once the scheme acts,
    the plans are costed on its stage scales (`plan_scale`): a frozen stage's third (no backward), the exits'
    cheaper last stage, MoD's routed half, the sparse layers'; the masked dense kernel of pruning costs what the
    dense layer did (no scale)."""
    run, plain = two[0][scheme], two[0]["dynamic"]["losses"]
    assert len(run["losses"]) == 6 and all(r[scheme]["losses"] == run["losses"] for r in two)
    same = {"pruning": 3, "sparse_attention": 1, "freezing": 3, "early_exit": 1, "mod": 1}[scheme]
    assert run["losses"][:same] == plain[:same]  # the steps before the scheme acts
    if scheme == "freezing":
        assert run["records"][-1]["frozen_layers"] == 2, run["records"][-1]  # layers 0-1: all of stage 0
    elif scheme == "early_exit":
        survival = run["records"][-1]["survival"]
        assert survival[3] < 0.5, survival  # most tokens left before stage 1's last layer
        assert survival[0] == 1.0, survival  # every token that enters the network runs the first layer
    elif scheme == "mod":
        assert [r["mod_capacity"] for r in run["records"]] == [1.0] + [0.5] * 5
    else:
        density = [r.get("layer_density") or r.get("attention_density") for r in run["records"]]
        assert min(density[-1]) < 1.0, density[-1]
    scale = run["records"][-1]["plan_scale"]
    if scheme == "pruning":
        assert scale is None
    elif scheme == "freezing":
        assert scale[0] < 0.4 and scale[1] == 1.0, scale
    elif scheme == "early_exit":
        assert scale[1] < 0.5 < scale[0], scale
    else:
        assert all(0 < x < 1 for x in scale), scale
    forced = two[0][f"{scheme}_forced"]
    assert forced["records"][-1]["sizes"] == [1, 3]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(forced["losses"], run["losses"], strict=True)), (
        forced["losses"], run["losses"])


def test_mixture_of_depths_keeps_the_share_of_each_samples_tokens_however_it_is_padded(two):
    """MoD on micro-batches padded two ways (the dynamic plan's and padding to the batch maximum): a padded row
    keeps half of its real tokens, chosen among them, so each sample's result, and the loss per token, is that of
    the other padding (to 1e-5: other shapes sum in another order). Were padding counted, it would take real
    tokens' places and the loss would depend on the plan."""
    dynamic, padding = two[0]["mod"], two[0]["mod_padding"]
    computed = [[r["computed_tokens"] for r in run["records"]] for run in (dynamic, padding)]
    assert all(a < b for a, b in zip(*computed)), computed  # the same samples, padded otherwise
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(dynamic["losses"], padding["losses"], strict=True)), (
        dynamic["losses"], padding["losses"])


def test_mixture_of_depths_under_fixed_micro_batches_keeps_the_share_of_each_samples_tokens(two):
    """Fixed micro-batching of padded samples (`data.samples: documents`) gives MoD each row's real tokens as the
    planned micro-batches do: the same losses (padding counted took real tokens' slots: 0.35 % apart at step 2;
    now 3e-8 at step 1, within 2e-5 after: other micro-batches sum in another order, at learning rate 1e-2), and a
    validation batch's summed loss is that of its rows run alone, unpadded."""
    fixed, padding = two[0]["mod_fixed"], two[0]["mod_padding"]
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(fixed["losses"], padding["losses"], strict=True)), (
        fixed["losses"], padding["losses"])
    assert fixed["padded_rows"] > 0
    (whole, count), (alone, count_alone) = fixed["eval_batch"], fixed["eval_rows"]
    assert count == count_alone and math.isclose(whole, alone, rel_tol=1e-5), (whole, alone)


@pytest.fixture(scope="module")
def four(corpus: str) -> list[dict]:
    return run_ranks(_four_ranks, 4, corpus)


@pytest.fixture(scope="module")
def lockstep(corpus: str) -> list[dict]:
    return run_ranks(_lockstep_ranks, 4, corpus, timeout_s=600)  # 9 short runs: a loaded host needs the time


def test_dynamic_micro_batches_with_data_parallel_pipelines(four):
    results = four
    ref, _ = reference_losses(docs(nproc=4), 3)
    _check(results, "dp", ref, reference_grads(docs(nproc=4)))
    recs = results[0]["dp"]["records"]
    assert all(r["micro_batches"] >= 2 for r in recs)
    assert [r["dp"]["ran"][0]["replica"] for r in results] == [0, 1, 0, 1]  # each replica plans its own


def test_a_re_pack_plans_the_micro_batches_drawn_ahead_again_for_the_stages_left(four):
    """4 stages re-packed onto 2 after step 2: the plans made ahead for 4 stages are made again for 2 (a new
    generation of plans, in the background workers), the released ranks stop, and the losses per token are those of
    the samples in one batch (1e-5), before and after the re-pack."""
    ref, _ = reference_losses(docs(pp=4, nproc=4), 5)
    runs = [r["repack"] for r in four]
    assert [len(r["losses"]) for r in runs] == [5, 2, 2, 5]  # ranks 1 and 2 released after step 2
    assert runs[0]["losses"] == runs[3]["losses"]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(runs[0]["losses"], ref, strict=True)), (
        runs[0]["losses"], ref)
    assert [len(p["replicas"][0]["streams"]) for p in runs[0]["plans"]] == [4, 4, 2, 2, 2]
    assert runs[0]["records"][1]["released_ranks"] == [1, 2]


def _repack_ep_ranks(rank: int, world: int, path: str) -> dict:
    import torch.distributed as dist

    SAMPLES["path"] = path
    # 3 stages x 2 expert shards in lockstep, re-packed onto 2 stages after step 2 (the middle stage's ranks
    # released), plans drawn 2 steps ahead in a background worker
    out = _train(docs(pp=3, nproc=6, moe=4, ep=2, z=1e-3, max_tokens=96, workers=1), 5, force=((2, (2, 2)),))
    dist.barrier()  # the released ranks wait here for the others
    return out


def test_a_re_pack_of_expert_parallel_stages_plans_the_lockstep_micro_batches_again(corpus):
    """The re-pack above with expert shards inside the stages: the plans made ahead for 3 stages are made again for
    2, still one plan per stage's 2 ranks in lockstep; the ranks still training report the same losses, those of
    the plans replayed in one process (1e-5)."""
    runs = run_ranks(_repack_ep_ranks, 6, corpus, timeout_s=600)
    assert [len(r["losses"]) for r in runs] == [5, 5, 2, 2, 5, 5]  # ranks 2 and 3 released after step 2
    live = [r for r in runs if len(r["losses"]) == 5]
    assert all(r["losses"] == live[0]["losses"] and r["records"][-1]["sizes"] == [2, 2] for r in live)
    plans = live[0]["plans"]
    assert [len(p["replicas"][0]["streams"]) for p in plans] == [3, 3, 2, 2, 2]
    assert all(p["lockstep"] == 2 for p in plans) and all(r["plans"] == plans for r in live)
    ref = planned_reference(docs(pp=3, nproc=6, moe=4, ep=2, z=1e-3, max_tokens=96), plans)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(live[0]["losses"], ref["losses"], strict=True)), (
        live[0]["losses"], ref["losses"])


def _same_schedule_per_stage(results: list[dict], case: str, ranks: int) -> None:
    """The ranks of a stage run the same instruction stream, each its own rows, together every planned row."""
    for step in range(len(results[0][case]["plans"])):
        plan = results[0][case]["plans"][step]
        assert plan["lockstep"] == ranks and all(r[case]["plans"][step] == plan for r in results)
        for stage in (0, 1):
            ran = [r[case]["ran"][step] for r in results if r[case]["ran"][step]["stage"] == stage]
            assert sorted(x["part"] for x in ran) == list(range(ranks))
            assert all(x["stream"] == ran[0]["stream"] and x["replica"] == ran[0]["replica"] for x in ran)
            for j, g in enumerate(plan["replicas"][ran[0]["replica"]]["micro_batches"]):
                mine = [x["rows"][j] for x in ran]
                assert all(mine)  # no rank runs a micro-batch empty
                assert sorted(r for rows in mine for r in rows) == sorted(map(tuple, plan["micro_batches"][g]["rows"]))


def test_expert_parallel_stages_run_planned_micro_batches_in_lockstep(lockstep):
    """pp 2 x ep 2: the losses, auxiliary losses and dense gradients of the planned run replayed in one process;
    without routing losses, the one-batch losses per token."""
    ep = lockstep[0]["ep"]
    _same_schedule_per_stage(lockstep, "ep", 2)
    ref = planned_reference(docs(nproc=4, moe=4, ep=2, z=1e-3, max_tokens=96), ep["plans"])
    assert all(r["ep"]["losses"] == ep["losses"] for r in lockstep)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ep["losses"], ref["losses"])), (ep["losses"], ref)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ep["aux"], ref["aux"])), (ep["aux"], ref["aux"])
    grads = _merge([r["ep"]["grads"] for r in lockstep])
    dense = {k: v for k, v in ref["grads"].items() if ".experts." not in k}
    assert set(dense) <= set(grads) and any("gate" in k for k in dense)
    for k, v in dense.items():  # the router's gradient carries the routing losses' summed statistics
        torch.testing.assert_close(grads[k], v, rtol=1e-4, atol=1e-6 * float(v.abs().max()), msg=k)
    assert all(r["micro_batches"] >= 2 for r in ep["records"])  # lockstep over several micro-batches
    _same_schedule_per_stage(lockstep, "ep_no_losses", 2)
    one_batch, _ = reference_losses(docs(nproc=4, moe=4, ep=2, aux=0.0, max_tokens=96), 3)
    got = lockstep[0]["ep_no_losses"]["losses"]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got, one_batch)), (got, one_batch)


@pytest.mark.parametrize("scheme", ["early_exit", "freezing", "pruning", "sparse_attention", "mod"])
def test_schemes_run_on_expert_parallel_stages_in_lockstep(lockstep, scheme):
    """Every scheme on planned micro-batches over 2 stages x 2 expert shards (lockstep): every rank reports the
    same losses, those of the run without the scheme until it acts, and the scheme acts (tokens gone before the
    last layers with their mask carried across the boundary; stage 0 frozen whole; the global top-k over the
    expert shards; densities below 1; MoD's capacity below 1 on padded rows)."""
    run, plain = lockstep[0][f"ep_{scheme}"], lockstep[0]["ep"]["losses"]
    assert len(run["losses"]) == 4 and all(r[f"ep_{scheme}"]["losses"] == run["losses"] for r in lockstep)
    same = {"early_exit": 1, "freezing": 3, "pruning": 3, "sparse_attention": 1, "mod": 1}[scheme]
    assert run["losses"][:same] == plain[:same]
    last = run["records"][-1]
    if scheme in ("early_exit", "freezing"):
        assert last["survival"][3] < 0.5 if scheme == "early_exit" else last["frozen_layers"] == 2, last
    elif scheme == "mod":
        assert last["mod_capacity"] == 0.5, last
    else:
        assert min(last.get("layer_density") or last["attention_density"]) < 1.0, last


def test_plan_ahead_inside_expert_parallel_stages_runs_on_planned_micro_batches(lockstep):
    """pp 2 x ep 2, planned micro-batches in lockstep, placement ahead of the gate: the plans and the losses of
    the same run with static placement (bit for bit until a replica's Agg has changed a gradient's summation
    order, then to 1e-7: a skipped Agg moves them by 2e-6); each stage's second MoE layer planned during its
    first once a profile exists, and replicas placed (so Trans and Agg ran)."""
    ahead, static = lockstep[0]["ep_ahead"], lockstep[0]["ep"]
    assert [p["micro_batches"] for p in ahead["plans"]] == [p["micro_batches"] for p in static["plans"]]
    assert ahead["losses"][:2] == static["losses"][:2]  # step 1 runs static placement everywhere: same update
    assert all(math.isclose(a, b, rel_tol=1e-7) for a, b in zip(ahead["losses"], static["losses"]))
    assert sum(sum(r["replicas"]) for r in ahead["records"]) > 0, [r["replicas"] for r in ahead["records"]]
    assert [r["plan_ahead_layers"] for r in ahead["records"]] == [[], [1, 3], [1, 3]]
    assert all(0 <= r["plan_ahead_path_overlap"] <= 1 for r in ahead["records"][1:])
    # the last step's estimate scaled from its first micro-batch to the rank's rows of every micro-batch
    for r in lockstep:
        ls, plan = r["ep_ahead"]["ran"][-1], r["ep_ahead"]["plans"][-1]
        first = next(j for op, j in ls["stream"] if op == "F")
        seq = [plan["micro_batches"][g]["seq"] for g in plan["replicas"][ls["replica"]]["micro_batches"]]
        tokens = [len(rows) * s for rows, s in zip(ls["rows"], seq)]
        assert r["ep_ahead"]["ahead_scale"] == pytest.approx(sum(tokens) / tokens[first])
        assert r["ep_ahead"]["ahead_scale"] > 1.0


def test_data_parallel_pipelines_with_moe_routing_losses_run_in_lockstep(lockstep):
    """pp 2 x dp 2 with the load-balancing loss: one plan for both replicas' ranks of a stage, replayed in one
    process (losses, auxiliary losses and every gradient)."""
    run = lockstep[0]["dp_moe"]
    _same_schedule_per_stage(lockstep, "dp_moe", 2)
    cfg = docs(nproc=4, moe=4, ep=1, max_tokens=96)
    ref = planned_reference(cfg, run["plans"])
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(run["aux"], ref["aux"])), (run["aux"], ref["aux"])
    _check(lockstep, "dp_moe", ref["losses"], ref["grads"])
    assert all(r["micro_batches"] >= 2 for r in run["records"])


def _resume_leg(cfg: Config, rank: int, world: int, root: str, resume: bool, stop: int | None,
                force: tuple = ()) -> dict:
    """One leg of a resume chain on 2 stages: `cfg` for 6 steps with a checkpoint every 2 (resumed from the
    latest with `resume`, stopped after step `stop`), migrated as `force` says; rank 0 returns the metrics
    records and the micro-batch cost table the planner holds at the end."""
    from moebal.distributed.groups import ParallelDims
    from moebal.train.pipelined import pipeline_trainer

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=6, ckpt_every=2, keep_checkpoints=10))
    trainer = pipeline_trainer(cfg, root, resume=resume, dims=ParallelDims(world_size=world, rank=rank, pp=2).init())
    runner = trainer.strategy.runner  # type: ignore[attr-defined]
    runner.force = list(force)
    try:
        trainer.train(stop_after=stop)
        table = runner.microbatches.cost.to_dict()
    finally:
        trainer.close()
    lines = (Path(root) / "metrics.jsonl").read_text().splitlines()
    return {"records": [r for r in map(json.loads, lines) if "loss" in r], "table": table} if rank == 0 else {}


def _scheme_leg(rank: int, world: int, path: str, root: str, resume: bool, stop: int | None) -> list[dict]:
    """`_resume_leg` with sparse attention's random walk (its densities, and so the plans' stage scales, move
    every step); the records."""
    SAMPLES["path"] = path
    cfg = dataclasses.replace(docs(), dynamism=from_dict({"dynamism": {"scheme": "sparse_attention",
                                                                       "sparse_attention": SPARSE}}).dynamism)
    return _resume_leg(cfg, rank, world, root, resume, stop).get("records", [])


def test_the_plans_follow_the_schemes_costs_and_a_resume_plans_the_batches_read_ahead_as_before(corpus, tmp_path):
    """Each batch is planned on the table's times scaled per stage by the scheme's prediction when it was read
    ahead (`plan_scale`, moving with the random walk). A checkpoint keeps the scales of the batches it had read
    ahead: resumed after step 4, steps 5 and 6 have the uninterrupted run's scales, plans and losses (with the
    resumed state's scale instead, step 5's differed)."""
    whole = run_ranks(_scheme_leg, 2, corpus, str(tmp_path / "whole"), False, None)[0]
    run_ranks(_scheme_leg, 2, corpus, str(tmp_path / "cut"), False, 4)
    resumed = run_ranks(_scheme_leg, 2, corpus, str(tmp_path / "cut"), True, None)[0]
    assert [r["step"] for r in whole] == list(range(1, 7)) and [r["step"] for r in resumed] == list(range(1, 7))
    scales = [r["plan_scale"] for r in whole]
    assert scales[0] is None and all(len(s) == 2 for s in scales[3:]) and len({str(s) for s in scales}) >= 4
    for a, b in zip(whole[4:], resumed[4:]):
        assert (a["plan_scale"], a["micro_batches"], a["predicted_time_s"]) == \
            (b["plan_scale"], b["micro_batches"], b["predicted_time_s"])
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6), (a["step"], a["loss"], b["loss"])


def _measured_leg(rank: int, world: int, path: str, root: str, resume: bool, stop: int | None,
                  force: tuple = ()) -> dict:
    """`_resume_leg` with a measured cost table (`pipeline.dynamic.costs: measure`) and a migration after step
    `force` when given."""
    SAMPLES["path"] = path
    return _resume_leg(docs(costs="measure"), rank, world, root, resume, stop, force)


@pytest.mark.parametrize("force", [(), ((3, (1, 3)),)], ids=["same-partition", "migrated"])
def test_a_resume_plans_with_the_measured_table_of_its_checkpoint(corpus, tmp_path, force):
    """A measured table is the checkpoint's: resumed after step 4, the planner holds the table the interrupted
    run measured (bit for bit; its own measurement at start-up would differ in the last digits), on the partition
    it was measured on: the launch's, or the one a migration after step 3 moved to (the resume migrates there
    and takes the saved table instead of measuring again)."""
    cut = run_ranks(_measured_leg, 2, corpus, str(tmp_path / "cut"), False, 4, force)[0]
    resumed = run_ranks(_measured_leg, 2, corpus, str(tmp_path / "cut"), True, None, force)[0]
    assert resumed["table"] == cut["table"] and cut["table"]["source"] == "measured at start-up"
    assert cut["table"]["meta"]["sizes"] == ([1, 3] if force else [2, 2])
    assert [r["step"] for r in resumed["records"]] == list(range(1, 7))


def _migrated_leg(rank: int, world: int, path: str, root: str, resume: bool, stop: int | None,
                  workers: int, migrate: bool = True) -> list[dict]:
    """`_resume_leg` on the analytic a100 table (rebuilt for each partition), planned in `workers` background
    processes (0: inline), with a migration after step 3 (`migrate`); the records."""
    SAMPLES["path"] = path
    force = ((3, (1, 3)),) if migrate else ()
    return _resume_leg(docs(workers=workers), rank, world, root, resume, stop, force).get("records", [])


def test_batches_read_ahead_are_planned_on_the_partition_that_runs_them(corpus, tmp_path):
    """A migration after step 3 plans the batches already read ahead (steps 4 and 5, lookahead 2) again on the
    new partition's table: planned in background workers they split as planned inline when the step asks (the
    table then in force), and a run resumed after step 4 plans steps 5 and 6 as the uninterrupted run did, bit
    for bit. Before, the workers kept the old partition's plans of steps 4 and 5 (step 4's predicted time was
    the old table's) and the resumed run planned step 5 on the new table."""
    def plans(records: list[dict]) -> list[tuple]:
        return [(r["step"], r["micro_batches"], r["predicted_time_s"], r["loss"]) for r in records]

    inline = run_ranks(_migrated_leg, 2, corpus, str(tmp_path / "inline"), False, None, 0)[0]
    whole = run_ranks(_migrated_leg, 2, corpus, str(tmp_path / "whole"), False, None, 1)[0]
    run_ranks(_migrated_leg, 2, corpus, str(tmp_path / "cut"), False, 4, 1)
    resumed = run_ranks(_migrated_leg, 2, corpus, str(tmp_path / "cut"), True, None, 1)[0]
    assert [r.get("migration") for r in whole][2] == "forced"
    assert plans(whole) == plans(inline)
    assert plans(resumed) == plans(whole)
    # the new table prices the same batches otherwise: planned on the old one, step 4 was predicted otherwise
    unmoved = run_ranks(_migrated_leg, 2, corpus, str(tmp_path / "unmoved"), False, 4, 1, False)[0]
    assert plans(unmoved)[:3] == plans(whole)[:3] and plans(unmoved)[3][2] != plans(whole)[3][2]
