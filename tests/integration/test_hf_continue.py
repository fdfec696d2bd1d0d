"""Continuation runs end to end: `moebal train configs/{mixtral,llama-moe,qwen-moe,olmoe}-continue.yaml` from a
tiny random checkpoint written by `transformers` (or with LLaMA-MoE's names) and a tokenizer.json built with
`tokenizers`; the first loss equals the reference's on the same batch and the export loads back (in `transformers`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from moebal.config import CONFIG_DIR
from moebal.data import build_data
from moebal.interop.hf import from_hf
from moebal.interop.hf_config import load
from tests.cli_util import Ran, run_cli
from tests.hf_util import (
    read_tensors,
    tiny_mixtral,
    tiny_olmoe,
    tiny_qwen2_moe,
    tiny_qwen3_moe,
    tiny_tokenizer,
    transformers_or_skip,
)

TEXTS = [f"document {i}: mixtures of experts route each token to a few experts; load balance keeps them busy. "
         f"the quick brown fox jumps over the lazy dog {i % 7} times." for i in range(24)]


def moebal(*args: str) -> Ran:
    """`moebal *args` in this process (tests/cli_util.py): no new interpreter importing torch per run."""
    return run_cli(*args)


def _corpus(tmp: Path) -> Path:
    path = tmp / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    return path


def _overrides(model_dir: Path, corpus: Path, steps: int, nproc: int = 1, pp: int = 1) -> list[str]:
    return [f"hf.init_from={model_dir}", f"data.tokenizer={model_dir / 'tokenizer.json'}", f"data.source={corpus}",
            "data.seq_len=32", "data.batch_size=4", "data.val_fraction=0.1", f"train.steps={steps}",
            "train.precision=fp32", "train.eval_every=0", "train.ckpt_every=0", "train.eval_batches=1",
            "train.warmup_steps=1", "train.lr=1e-3", f"parallel.nproc={nproc}", f"parallel.ep={nproc // pp}",
            f"parallel.pp={pp}", "planner.policy=static"]


def _first_loss(run: Path) -> float:
    return float(json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"])


def _assert_first_loss_is_transformers(run: Path, ref: Any, batch: Any) -> None:
    """The run's first logged loss equals transformers' loss of `ref` on the same first batch (within 1e-4)."""
    with torch.no_grad():
        logits = ref(batch.ids_BT).logits
    want = F.cross_entropy(logits.flatten(0, 1), batch.labels_BT.flatten(), ignore_index=-100).item()
    assert abs(_first_loss(run) - want) < 1e-4, (_first_loss(run), want)


@pytest.mark.parametrize("nproc, pp", [(1, 1), (2, 1), (2, 2)], ids=["one-process", "expert-parallel", "pipeline"])
def test_mixtral_continue_matches_transformers_and_exports(tmp_path, nproc, pp):
    transformers = transformers_or_skip()
    model_dir = tmp_path / "mixtral"
    ref = tiny_mixtral(model_dir, seed=nproc + pp)
    tiny_tokenizer(model_dir, TEXTS, vocab_size=96)
    corpus, run = _corpus(tmp_path), tmp_path / "run"
    overrides = _overrides(model_dir, corpus, steps=3, nproc=nproc, pp=pp)
    r = moebal("train", str(CONFIG_DIR / "mixtral-continue.yaml"), "--out", str(run), *overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported step 3" in r.stderr

    # the first logged loss is transformers' loss on the same first batch
    cfg = load(CONFIG_DIR / "mixtral-continue.yaml", overrides)
    assert cfg.data.add_special_tokens and cfg.moe.num_experts == 4
    batch = build_data(cfg).train.next_batch()
    assert (batch.ids_BT == 0).any()  # <s> (id 0) starts every document: add_special_tokens reached the data
    _assert_first_loss_is_transformers(run, ref, batch)

    # the export (consolidated over expert-parallel ranks or pipeline stages) loads in transformers and holds
    # the final checkpoint's weights, which training moved away from the start
    export = run / "hf"
    assert (export / "tokenizer.json").is_file()
    assert json.loads((export / "config.json").read_text())["router_aux_loss_coef"] == 0.02
    back = transformers.MixtralForCausalLM.from_pretrained(str(export)).eval()
    final = {k: v for k, v in back.state_dict().items()}
    start = ref.state_dict()
    assert set(final) == set(start)
    assert any(not torch.equal(final[k], start[k]) for k in start)
    ours = from_hf(export).eval()
    ids = batch.ids_BT[:2]
    with torch.no_grad():
        assert (ours(ids).logits - back(ids).logits).abs().max().item() < 1e-4
    exported = read_tensors(export)
    again = tmp_path / "again"
    c = moebal("convert", "moebal-to-hf", str(run), str(again))  # the run directory: its newest checkpoint
    assert c.returncode == 0, c.stderr[-2000:]
    assert all(torch.equal(exported[k], v) for k, v in read_tensors(again).items())
    if nproc == 1 and pp == 1:  # resuming reads the run's checkpoint (not hf.init_from's weights) and exports again
        r2 = moebal("train", "--out", str(run), "--resume", "--steps", "4")
        assert r2.returncode == 0, r2.stderr[-3000:]
        assert "exported step 4" in r2.stderr
        steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3, 4]
        assert any(not torch.equal(exported[k], v) for k, v in read_tensors(export).items())


def test_llama_moe_continue_first_loss_and_export(tmp_path):
    from tests.unit.test_llama_moe import V, _config, _state_dict, _write, reference_logits

    model_dir = _write(tmp_path / "llama-moe", _config(8, 2, 4.0, 12, torch_dtype="float32"), _state_dict(8, 12, 9))
    (model_dir / "modeling_llama_moe_hf.py").write_text("# remote code travels with the export\n")
    tiny_tokenizer(model_dir, TEXTS, vocab_size=V)
    corpus, run = _corpus(tmp_path), tmp_path / "run"
    # without the training-time gate noise the first loss is a pure function of the weights and the batch
    overrides = [*_overrides(model_dir, corpus, steps=2), "moe.router_noise=null"]
    r = moebal("train", str(CONFIG_DIR / "llama-moe-continue.yaml"), "--out", str(run), *overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = load(CONFIG_DIR / "llama-moe-continue.yaml", overrides)
    assert (cfg.moe.router, cfg.moe.gate, cfg.moe.score_scale) == ("mlp_tanh", "topk_softmax", 4.0)
    batch = build_data(cfg).train.next_batch()
    sd = read_tensors(model_dir)
    logits = reference_logits(sd, batch.ids_BT, 8, 2, 4.0)
    want = F.cross_entropy(logits.flatten(0, 1), batch.labels_BT.flatten(), ignore_index=-100).item()
    assert abs(_first_loss(run) - want) < 1e-4, (_first_loss(run), want)
    export = run / "hf"
    base = json.loads((model_dir / "config.json").read_text())
    written = json.loads((export / "config.json").read_text())
    assert written["auto_map"] == base["auto_map"] and written["gate_add_noise"] is False
    assert (export / "modeling_llama_moe_hf.py").is_file()
    names = set(read_tensors(export))
    # weight_noise is not trained without noise, so it is not exported; everything else keeps its name
    assert names == {n for n in sd if not n.endswith(("inv_freq", "weight_noise.weight"))}


FAMILIES = {  # preset, the tiny checkpoint, its transformers class
    "qwen3_moe": ("qwen-moe-continue", lambda d: tiny_qwen3_moe(d, seed=3), "Qwen3MoeForCausalLM"),
    "qwen2_moe-no-shared": ("qwen-moe-continue",
                            lambda d: tiny_qwen2_moe(d, seed=4, shared_expert_intermediate_size=0, mlp_only_layers=[3]),
                            "Qwen2MoeForCausalLM"),
    "olmoe": ("olmoe-continue", lambda d: tiny_olmoe(d, seed=5), "OlmoeForCausalLM"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_qwen_and_olmoe_continue_match_transformers_and_export(tmp_path, family):
    """The first logged loss is transformers' loss on the same batch; the export keeps the source's config.json
    and tokenizer, loads with AutoModelForCausalLM and holds the trained weights."""
    transformers = transformers_or_skip()
    preset, make, cls = FAMILIES[family]
    model_dir = tmp_path / "src"
    ref = make(model_dir)
    tiny_tokenizer(model_dir, TEXTS, vocab_size=96)
    corpus, run = _corpus(tmp_path), tmp_path / "run"
    overrides = _overrides(model_dir, corpus, steps=2)
    r = moebal("train", str(CONFIG_DIR / f"{preset}.yaml"), "--out", str(run), *overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported step 2" in r.stderr
    cfg = load(CONFIG_DIR / f"{preset}.yaml", overrides)
    batch = build_data(cfg).train.next_batch()
    _assert_first_loss_is_transformers(run, ref, batch)
    export = run / "hf"
    assert json.loads((export / "config.json").read_text()) == json.loads((model_dir / "config.json").read_text())
    assert (export / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    back = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    assert type(back).__name__ == cls
    final, start = back.state_dict(), ref.state_dict()
    assert set(final) == set(start) and any(not torch.equal(final[k], start[k]) for k in start)
    with torch.no_grad():
        ids = batch.ids_BT[:2]
        assert (from_hf(export).eval()(ids).logits - back(ids).logits).abs().max().item() < 1e-4


def test_a_sliding_window_checkpoint_trains_on_sequences_longer_than_its_window(tmp_path):
    """Mixtral with a window of 12 trained on 32-token sequences: the first loss is transformers' (which masks
    beyond the window too), and the export keeps the window."""
    model_dir = tmp_path / "mixtral"
    ref = tiny_mixtral(model_dir, seed=6, sliding_window=12)
    tiny_tokenizer(model_dir, TEXTS, vocab_size=96)
    corpus, run = _corpus(tmp_path), tmp_path / "run"
    overrides = _overrides(model_dir, corpus, steps=1)
    r = moebal("train", str(CONFIG_DIR / "mixtral-continue.yaml"), "--out", str(run), *overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = load(CONFIG_DIR / "mixtral-continue.yaml", overrides)
    assert (cfg.model.sliding_window, cfg.data.seq_len) == (12, 32)
    batch = build_data(cfg).train.next_batch()
    _assert_first_loss_is_transformers(run, ref, batch)
    assert json.loads((run / "hf" / "config.json").read_text())["sliding_window"] == 12


def test_continue_presets_refuse_a_missing_checkpoint(tmp_path):
    r = moebal("train", "mixtral-continue", f"hf.init_from={tmp_path / 'nope'}", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "hf.init_from" in r.stderr and "is not a directory" in r.stderr
