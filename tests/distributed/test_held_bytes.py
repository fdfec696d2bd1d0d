"""The layer balancer's memory estimate (`moebal.pipeline.observe.held_bytes`) against the storages a rank really
holds between steps (`moebal.distributed.sharded.model_state_bytes`), for every way moebal keeps model state:
unsharded, ZeRO-2 (`shard: optimizer`, with and without bf16 compute copies beside fp32 masters) and fully
sharded (`shard: full`: FSDP2 shards for the dense weights, expert weights sharded at rest), on 4 gloo ranks
(ep 2 x dp 2, so every sharded kind has 2 or 4 ranks to split over). Weights and optimizer state must match the
storages to the flats' padding and AdamW's step counters; a DTensor or an expert weight at rest counted whole
would be 2x to 4x off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moebal.distributed.testing import run_ranks
from tests.distributed.shard_parity import shard_cfg

LAYOUTS = {
    "none": ("none", {}),
    "optimizer": ("optimizer", {}),
    "optimizer_bf16": ("optimizer", {"param_dtype": "bf16"}),
    "full": ("full", {}),
    "full_bf16": ("full", {"param_dtype": "bf16"}),
}


def _held(rank: int, world: int, root: str) -> dict[str, dict[str, int]]:
    from moebal.distributed.sharded import model_state_bytes
    from moebal.pipeline.observe import held_bytes
    from moebal.train.distributed import setup_parallel
    from moebal.train.trainer import Trainer

    torch.set_num_threads(1)
    out = {}
    for name, (shard, parallel) in LAYOUTS.items():
        precision = "bf16" if parallel else "fp32"
        cfg = shard_cfg(shard, 2, "broadcast_topk", steps=2, precision=precision, parallel=parallel)
        run = Path(root) / name
        ctx, model, hooks = setup_parallel(cfg, run_dir=run)
        trainer = Trainer(cfg, run, model=model, hooks=hooks, ctx=ctx)
        trainer.train()
        est = held_bytes(trainer.model, trainer.optimizer)
        real = model_state_bytes(trainer.model, trainer.optimizer)
        out[name] = {**{f"est_{k}": v for k, v in est.items()}, **{f"real_{k}": v for k, v in real.items()},
                     "at_rest": int(getattr(trainer.optimizer, "experts_at_rest", 0))}
        trainer.close()
    return out


@pytest.fixture(scope="module")
def held(tmp_path_factory) -> list[dict[str, dict[str, int]]]:
    return run_ranks(_held, 4, str(tmp_path_factory.mktemp("held")), timeout_s=600)


def test_held_weights_and_optimizer_state_match_the_storages_in_every_layout(held):
    for r in held:
        assert r["full"]["at_rest"] == 2 and r["full_bf16"]["at_rest"] == 2  # the expert weights are at rest
        for name, got in r.items():
            est = got["est_weights"] + got["est_optimizer"]
            real = got["real_params"] + got["real_optimizer"]
            assert abs(est - real) <= 0.01 * real, (name, got)


def test_sharding_shrinks_the_estimate_as_the_layouts_promise(held):
    for r in held:
        total = {name: got["est_weights"] + got["est_grads"] + got["est_optimizer"] for name, got in r.items()}
        assert total["full"] < total["optimizer"] < total["none"], total
        # fp32, 16 bytes a parameter unsharded; ZeRO-2 over 2-4 ranks keeps the weights and gradients whole
        none, zero2 = r["none"], r["optimizer"]
        assert none["est_weights"] == none["est_grads"] and none["est_optimizer"] > 1.9 * none["est_weights"]
        assert zero2["est_weights"] == none["est_weights"] and zero2["est_optimizer"] < 0.51 * none["est_optimizer"]
        # full: every weight split over 2 (experts) or 4 (dense) ranks
        assert r["full"]["est_weights"] < 0.51 * none["est_weights"]
