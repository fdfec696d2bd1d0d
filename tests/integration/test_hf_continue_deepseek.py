"""DeepSeek continuation runs end to end: `moebal train configs/deepseek-continue.yaml` from tiny random V2 and V3
checkpoints written by `transformers`, in one process, expert-parallel over 2 ranks and in 2 pipeline stages: the
first loss equals transformers' loss on the same batch, and the export loads back into transformers."""

from __future__ import annotations

import json

import pytest
import torch

from moebal.config import CONFIG_DIR
from moebal.data import build_data
from moebal.interop.hf_config import load
from tests.hf_util import tiny_tokenizer, transformers_or_skip
from tests.integration.test_hf_continue import (
    TEXTS,
    _assert_first_loss_is_transformers,
    _corpus,
    _overrides,
    moebal,
)
from tests.unit.test_hf_deepseek import tiny_deepseek

CASES = {"v3-one-process": (3, 1, 1), "v3-expert-parallel": (3, 2, 1), "v2lite-expert-parallel": (2, 2, 1),
         "v3-pipeline": (3, 2, 2)}


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_continue_matches_transformers_and_exports(tmp_path, case):
    version, nproc, pp = CASES[case]
    transformers = transformers_or_skip()
    model_dir = tmp_path / "deepseek"
    extra = dict(n_group=4, topk_group=2) if version == 3 else dict(q_lora_rank=None, n_shared_experts=2)
    ref = tiny_deepseek(model_dir, version, seed=nproc, **extra)
    tiny_tokenizer(model_dir, TEXTS, vocab_size=96)
    corpus, run = _corpus(tmp_path), tmp_path / "run"
    overrides = _overrides(model_dir, corpus, steps=2, nproc=nproc, pp=pp)
    r = moebal("train", str(CONFIG_DIR / "deepseek-continue.yaml"), "--out", str(run), *overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported step 2" in r.stderr

    cfg = load(CONFIG_DIR / "deepseek-continue.yaml", overrides)
    assert cfg.model.mla is not None and cfg.moe.router_fp32
    batch = build_data(cfg).train.next_batch()
    _assert_first_loss_is_transformers(run, ref, batch)

    export = run / "hf"
    assert json.loads((export / "config.json").read_text())["model_type"] == f"deepseek_v{version}"
    back = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    final, start = back.state_dict(), ref.state_dict()
    assert set(final) == set(start)
    assert any(not torch.equal(final[k], start[k]) for k in start)  # training moved the weights


def test_v3_expert_parallel_losses_equal_one_process(tmp_path):
    """Two steps of a DeepSeek-V3 continuation (sigmoid groups, selection bias updated every step) on 2
    expert-parallel ranks log the losses of one process."""
    model_dir = tmp_path / "deepseek"
    tiny_deepseek(model_dir, 3, seed=7, n_group=4, topk_group=2)
    tiny_tokenizer(model_dir, TEXTS, vocab_size=96)
    corpus = _corpus(tmp_path)
    losses = []
    for nproc in (1, 2):
        run = tmp_path / f"run{nproc}"
        overrides = [*_overrides(model_dir, corpus, steps=3, nproc=nproc), "moe.bias_update_rate=0.01"]
        r = moebal("train", str(CONFIG_DIR / "deepseek-continue.yaml"), "--out", str(run), *overrides)
        assert r.returncode == 0, r.stderr[-3000:]
        losses.append([json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()])
    assert len(losses[0]) == 3 and max(abs(a - b) for a, b in zip(*losses)) < 1e-5, losses
