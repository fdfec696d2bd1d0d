"""Pipeline engine on real gloo ranks: parity with the single-process model, and migrations that change nothing.

Spawning ranks costs seconds (torch and its optimizer imports), so each world size is spawned once per
module (a fixture) and runs every short training the tests below check (tiny model, a few steps each).
"""

from __future__ import annotations

import math

import pytest
import torch

from moebal.config import Config, from_dict
from moebal.dist.testing import run_ranks


def tiny(n_layers: int = 4, pp: int = 2, moe: int = 0, batch: int = 8, nproc: int | None = None,
         **train: float) -> Config:
    return from_dict({
        "model": {"dim": 32, "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        "moe": {"num_experts": moe, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop"},
        "data": {"seq_len": 16, "batch_size": batch, "max_bytes": 200_000},
        "train": {"steps": 6, "warmup_steps": 0, "lr": 1e-2, "eval_every": 0, **train},
        "parallel": {"pp": pp, "nproc": nproc or pp}})


def reference_losses(cfg: Config, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain single-process loop: whole-batch forward, backward, clip, AdamW."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two OpenMP threads on a loaded 2-core machine run tiny GEMMs 100x slower
    try:
        return _reference(cfg, steps)
    finally:
        torch.set_num_threads(threads)


def _reference(cfg: Config, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    from moebal.data import build_data
    from moebal.models import build_model
    from moebal.train.optim import build_optimizer, lr_at
    from moebal.train.trainer import seed_everything

    data = build_data(cfg)
    seed_everything(cfg.train.seed)
    model = build_model(cfg)
    opt = build_optimizer(model, cfg.train)
    losses = []
    for s in range(steps):
        b = data.train.next_batch()
        for g in opt.param_groups:
            g["lr"] = lr_at(s, cfg.train)
        out = model(b.ids_BT, b.labels_BT)
        (out.loss + out.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(cfg: Config, steps: int, **opts):
    from moebal.pipeline.runner import PipelineOptions, PipelineRunner

    runner = PipelineRunner(cfg, PipelineOptions(**opts))
    out = runner.train(steps)
    return {"losses": [r["loss"] for r in out.records], "sizes": out.final_sizes, "released": out.released,
            # numpy, not tensors: torch's queue would share tensor memory with a process that is about to exit
            "state": {k: v.numpy() for k, v in runner.full_state().items()}, "records": out.records}


def _two_ranks(rank: int, world: int) -> dict:
    torch.manual_seed(1234 + rank)  # a different global RNG state per rank must not matter
    cfg = tiny(pp=world)
    six = tiny(n_layers=6, pp=world)
    return {
        "1f1b": _train(cfg, 4, micro_batches=4),
        "gpipe_uneven": _train(cfg, 4, schedule="gpipe", micro_batches=3),
        "moe_m1": _train(tiny(pp=world, moe=4), 3, micro_batches=1),
        "static": _train(six, 5, micro_batches=4),
        "forced": _train(six, 5, micro_batches=4, force=((1, (4, 2)), (2, (1, 5)), (3, (2, 4)))),
        "mid": _train(six, 5, micro_batches=4, force_mid=((2, (5, 1)),), force=((3, (3, 3)),)),
    }


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_ranks(_two_ranks, 2)


def _four_ranks(rank: int, world: int) -> dict:
    cfg = tiny(n_layers=4, pp=2, nproc=4)  # 2 stages x 2 data-parallel replicas
    return {"dp_static": _train(cfg, 4, micro_batches=2),
            "dp_forced": _train(cfg, 4, micro_batches=2, force=((2, (1, 3)),))}


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_ranks(_four_ranks, 4)


def _merge(states: list[dict]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for s in states:
        out.update({k: torch.from_numpy(v) for k, v in s.items()})
    return out


def test_pipeline_matches_single_process_model(two):
    results = two
    ref, ref_state = reference_losses(tiny(pp=2), 4)
    for case in ("1f1b", "gpipe_uneven"):
        got = results[0][case]["losses"]
        assert got == results[1][case]["losses"]  # every rank reports the same loss
        assert all(math.isclose(a, b, rel_tol=2e-6) for a, b in zip(got, ref)), (case, got, ref)
        state = _merge([r[case]["state"] for r in results])
        assert set(state) == set(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=f"{case}: {k}")
    moe_ref, _ = reference_losses(tiny(pp=2, moe=4), 3)
    got = results[0]["moe_m1"]["losses"]
    assert all(math.isclose(a, b, rel_tol=2e-6) for a, b in zip(got, moe_ref)), (got, moe_ref)


def test_forced_migrations_give_exactly_the_static_losses_and_parameters(two):
    results = two
    static = results[0]["static"]
    static_state = _merge([r["static"]["state"] for r in results])
    for case, final in (("forced", [2, 4]), ("mid", [3, 3])):
        assert results[0][case]["losses"] == static["losses"], case  # bit-identical, not close
        assert results[0][case]["sizes"] == final
        state = _merge([r[case]["state"] for r in results])
        for k, v in static_state.items():
            assert torch.equal(state[k], v), f"{case}: {k} differs after migration"
    rec = results[0]["forced"]["records"]
    assert rec[0]["layers_moved"] == 1 and rec[0]["sizes_after"] == [4, 2]
    assert rec[1]["layers_moved"] == 3 and rec[1]["bytes_moved"] > 0
    assert rec[2]["layers_moved"] == 1


def test_pipeline_with_data_parallel_matches_single_process_and_migrates(four):
    results = four
    ref, _ = reference_losses(tiny(pp=2), 4)
    got = results[0]["dp_static"]["losses"]
    assert all(r["dp_static"]["losses"] == got for r in results)
    assert all(math.isclose(a, b, rel_tol=2e-6) for a, b in zip(got, ref)), (got, ref)
    assert all(r["dp_forced"]["losses"] == got for r in results)
    assert all(r["dp_forced"]["sizes"] == [1, 3] for r in results)
