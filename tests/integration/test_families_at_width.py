"""Today's MoE families trained at their routing width: 64 experts, top-8, Pro-Prophet placement (replicas
included) on 2 expert-parallel ranks, DeepSeek-V3 with its sigmoid group-limited gate and a selection bias
updated every step; checkpointed, resumed on one process and again on 2 ranks: every resumed step logs the
uninterrupted run's loss within the expert-parallel parity tolerance (1e-5 relative; another layout adds the
same numbers in another order). The planner plans on a hardware profile's figures, not on a measurement of
this machine, so that its choice of replicas is the same every run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moebal.config import CONFIG_DIR
from tests.hf_util import tiny_qwen3_moe, tiny_tokenizer
from tests.integration.test_hf_continue import TEXTS, _corpus, moebal
from tests.unit.test_hf_deepseek import tiny_deepseek

STEPS = 6
WIDE = {
    "qwen3-moe": ("qwen-moe-continue.yaml", lambda d: tiny_qwen3_moe(d, seed=3, num_experts=64,
                                                                     num_experts_per_tok=8)),
    "deepseek-v3": ("deepseek-continue.yaml", lambda d: tiny_deepseek(d, 3, seed=3, n_routed_experts=64,
                                                                      num_experts_per_tok=8, n_group=8,
                                                                      topk_group=4)),
}


def _train(run: Path, preset: str, model_dir: Path, corpus: Path, nproc: int, *extra: str) -> None:
    r = moebal("train", str(CONFIG_DIR / preset), "--out", str(run), f"hf.init_from={model_dir}",
               f"data.tokenizer={model_dir / 'tokenizer.json'}", f"data.source={corpus}", "data.seq_len=32",
               "data.batch_size=4", "data.val_fraction=0.1", f"train.steps={STEPS}", "train.precision=fp32",
               "train.eval_every=0", "train.ckpt_every=2", f"train.keep_checkpoints={STEPS}", "train.warmup_steps=1",
               "train.lr=1e-3", "hf.export_to=null", f"parallel.nproc={nproc}", f"parallel.ep={nproc}",
               "planner.policy=prophet", "planner.costs=h100",
               "moe.bias_update_rate=0.001" if "deepseek" in preset else "moe.jitter=0.0", *extra)
    assert r.returncode == 0, r.stderr[-3000:]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _keep_until(run: Path, step: int) -> None:
    for later in (p for p in run.glob("ckpt-*") if int(p.name[5:]) > step):
        shutil.rmtree(later)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(WIDE))
def test_64_experts_top8_place_checkpoint_and_resume_across_layouts(tmp_path, family):
    preset, build = WIDE[family]
    model_dir = tmp_path / family
    build(model_dir)
    tiny_tokenizer(model_dir, TEXTS, vocab_size=96)
    corpus = _corpus(tmp_path)
    whole = tmp_path / "whole"
    _train(whole, preset, model_dir, corpus, 2)
    want = _losses(whole)
    plans = [json.loads(line) for line in (whole / "plans.jsonl").read_text().splitlines()]
    assert len(plans) == STEPS
    assert all(len(p["counts"][0]) == 2 and len(p["counts"][0][0]) == 64 for p in plans)
    used = [pl for p in plans for pl in p["used"]]
    assert all(len(pl["owner"]) == 64 for pl in used)
    assert any(pl["policy"] == "prophet" and any(pl["replicas"]) for pl in used)  # replicas took part

    run = tmp_path / "run"
    shutil.copytree(whole, run)
    for nproc, resume_at in ((1, 2), (2, 4)):  # 2 ranks -> 1 process -> 2 ranks
        _keep_until(run, resume_at)
        _train(run, preset, model_dir, corpus, nproc, "--resume")
        got = _losses(run)
        assert sorted(got) == list(range(1, STEPS + 1))
        for s in range(resume_at + 1, STEPS + 1):
            assert abs(got[s] - want[s]) <= 1e-5 * want[s], (family, nproc, s, got[s], want[s])
