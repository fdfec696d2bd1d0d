"""Planned micro-batching on real gloo ranks: variable-size micro-batches (DynaPipe), padding to the batch
maximum, planned communication and planning ahead give the same loss per token and the same parameters as
the same samples trained in one batch by one process."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks

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


def docs(pp: int = 2, nproc: int | None = None, method: str = "dynamic", moe: int = 0, **dynamic: object) -> Config:
    """A tiny model on variable-length samples (one per .jsonl line): long-tailed lengths."""
    return from_dict({
        "model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 64},
        "moe": {"num_experts": moe, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop"},
        "data": {"source": SAMPLES["path"], "seq_len": 64, "batch_size": 12, "samples": "documents",
                 "val_fraction": 0.0},
        "train": {"steps": 3, "warmup_steps": 0, "lr": 1e-2, "eval_every": 0, "precision": "fp32"},
        "parallel": {"pp": pp, "nproc": nproc or pp},
        "pipeline": {"microbatching": method,
                     "dynamic": {"costs": "a100", "max_tokens": 192, "workers": 0, **dynamic}}})


def _train(cfg: Config, steps: int) -> dict:
    """The losses of `steps` steps and the first step's gradients (summed over replicas, before clipping)."""
    from moebal.pipeline.planned import PlannedPipelineRunner

    class Capture(PlannedPipelineRunner):
        grads: dict = {}

        def _sync_grads(self) -> None:
            super()._sync_grads()
            if self.step == 1:
                self.grads = {k: p.grad.numpy().copy() for k, p in self.stage.named_parameters()
                              if p.grad is not None}

    runner = Capture(cfg)
    out = runner.train(steps)
    return {"losses": [r["loss"] for r in out.records], "records": out.records, "grads": runner.grads}


def reference_grads(cfg: Config) -> dict[str, torch.Tensor]:
    """Gradients of the mean token loss of the first batch, all samples in one padded batch, one process."""
    from moebal.data import build_data
    from moebal.models import build_model
    from moebal.train.trainer import seed_everything

    seed_everything(cfg.train.seed)
    model = build_model(cfg)
    batch = build_data(cfg).train.next_batch()
    out = model(batch.ids_BT, batch.labels_BT)
    (out.loss + out.aux_loss).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _two_ranks(rank: int, world: int, path: str) -> dict:
    SAMPLES["path"] = path
    return {
        "dynamic": _train(docs(), 3),                                   # both schedules simulated, the faster run
        "adaptive": _train(docs(schedules="adaptive", workers=1), 3),   # in a background planning process
        "one_f_one_b": _train(docs(schedules="1f1b"), 3),
        "padding": _train(docs(method="padding"), 3),
        "moe": _train(docs(moe=4), 2),
    }


def _four_ranks(rank: int, world: int, path: str) -> dict:
    SAMPLES["path"] = path
    return {"dp": _train(docs(nproc=4), 3)}  # 2 stages x 2 data-parallel pipelines, Karmarkar-Karp


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


def test_dynamic_micro_batches_with_data_parallel_pipelines(corpus):
    results = run_ranks(_four_ranks, 4, corpus)
    ref, _ = reference_losses(docs(nproc=4), 3)
    _check(results, "dp", ref, reference_grads(docs(nproc=4)))
    recs = results[0]["dp"]["records"]
    assert all(r["micro_batches"] >= 2 for r in recs)
