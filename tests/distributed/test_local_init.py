"""Rank-local start-up on real gloo ranks: an expert-parallel rank (setup_parallel) and a pipeline stage
(PipelineRunner, also with expert parallelism inside the stage, and from `hf.init_from`) hold exactly their
part of the single-process model, bit for bit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks


def _cfg(pp: int = 1, nproc: int = 2, ep: int | None = None, tie: bool = False) -> Config:
    return from_dict({
        "model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32,
                  "tie_embeddings": tie},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop"},
        "data": {"seq_len": 16, "batch_size": 8, "max_bytes": 200_000},
        "train": {"steps": 1, "warmup_steps": 0, "eval_every": 0, "precision": "fp32", "seed": 11},
        "parallel": {"pp": pp, "nproc": nproc, "ep": ep}})


def _reference(cfg: Config) -> dict[str, torch.Tensor]:
    from moebal.models import build_model
    from moebal.train.trainer import seed_everything

    if cfg.hf.init_from:
        from moebal.interop.hf import from_hf

        return from_hf(cfg.hf.init_from, cfg=cfg).state_dict()
    seed_everything(cfg.train.seed)
    return build_model(cfg).state_dict()


def _compare(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rows: tuple[int, ...] | None) -> int:
    """Tensors of `state` equal to the reference's (expert tensors: its rows `rows`); their count."""
    for k, v in state.items():
        want = ref[k]
        if rows is not None and ".experts.w" in k:
            want = want[list(rows)]
        assert torch.equal(v.detach(), want), k
    return len(state)


def _setup_worker(rank: int, world: int) -> int:
    from moebal.train.distributed import setup_parallel

    cfg = _cfg()
    _, model, _ = setup_parallel(cfg)
    mine = (2 * rank, 2 * rank + 1)
    assert all(m.experts.expert_ids == mine for m in model.moe_layers())
    return _compare(model.state_dict(), _reference(cfg), mine)


def test_expert_parallel_ranks_initialise_their_own_experts_only():
    counts = run_ranks(_setup_worker, 2, timeout_s=600.0)
    assert counts[0] == counts[1] > 10


def _stage_worker(rank: int, world: int, hf_dir: str | None, tie: bool = False) -> list[int]:
    """Tied embeddings (`tie`): the last stage's head copy equals the reference's head, the embedding."""
    from moebal.pipeline.runner import PipelineRunner

    out = []
    for pp, ep in ((2, 1), (2, 2)) if world == 4 else ((2, 1),):
        cfg = _cfg(pp=pp, nproc=world, ep=ep, tie=tie)
        if hf_dir is not None:
            cfg = dataclasses.replace(cfg, hf=dataclasses.replace(cfg.hf, init_from=hf_dir))
        runner = PipelineRunner(cfg)
        st = runner.stage
        layers = st.layer_ids
        assert layers == ([0, 1] if runner.chain.is_first else [2, 3])
        state = runner.full_state()
        assert {k.split(".")[2] for k in state if k.startswith("model.layers.")} == {str(i) for i in layers}
        assert ("model.embed_tokens.weight" in state) == runner.chain.is_first
        assert ("lm_head.weight" in state) == runner.chain.is_last
        rows = None
        if ep > 1:
            e = runner.dims.index("ep")
            rows = (2 * e, 2 * e + 1)
        out.append(_compare(state, _reference(cfg), rows))
        runner.close()
    return out


def test_pipeline_stages_initialise_their_own_layers_only():
    assert all(n > 5 for r in run_ranks(_stage_worker, 4, None, timeout_s=600.0) for n in r)


@pytest.mark.parametrize("tie", [False, True])
def test_pipeline_stages_read_their_own_tensors_from_hf_init_from(tmp_path: Path, tie: bool):
    from moebal.interop.hf import to_hf
    from moebal.models import build_model

    torch.manual_seed(5)
    to_hf(build_model(_cfg(tie=tie)), tmp_path / "ckpt", arch="mixtral")
    assert all(n > 5 for r in run_ranks(_stage_worker, 2, str(tmp_path / "ckpt"), tie, timeout_s=600.0) for n in r)


def test_tied_pipeline_stages_initialise_the_head_copy_as_the_embedding():
    assert all(n > 5 for r in run_ranks(_stage_worker, 2, None, True, timeout_s=600.0) for n in r)
