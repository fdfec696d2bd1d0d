"""Recording a run's routing (train.record_routing_every) and building Lina's path profile from it (`moebal paths`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moebal.planner.paths import PathProfile, build_profile
from moebal.train.routing_log import load_routing
from tests.cli_util import Ran, run_cli
from tests.unit.test_train import TINY


def moebal(*args: str) -> Ran:
    """`moebal *args` in this process (tests/cli_util.py)."""
    return run_cli(*args)


def test_record_routing_then_build_profile(tmp_path: Path) -> None:
    out = tmp_path / "run"
    tiny = [x for x in TINY if not x.startswith("train.steps=")]
    r = moebal("train", "--out", str(out), *tiny, "train.steps=4", "train.record_routing_every=2",
               "parallel.nproc=1")
    assert r.returncode == 0, r.stderr
    samples = load_routing(out)
    assert [p.name for p in sorted((out / "routing").iterdir())] == ["step_000002.npz", "step_000004.npz"]
    # [L=2 MoE layers, T = batch 4 x 32 tokens, K = 2], valid expert ids, two distinct choices per token
    assert all(s.shape == (2, 128, 2) for s in samples)
    assert all(s.min() >= 0 and s.max() < 4 and (s[..., 0] != s[..., 1]).all() for s in samples)
    r = moebal("paths", str(out), "-o", str(tmp_path / "p.npz"), "--path-len", "3")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["samples"] == 2 and info["layers"] == 2 and info["top_k"] == 2
    prof = PathProfile.load(tmp_path / "p.npz")
    ref = build_profile(samples, 4, 3)
    top1_TL = np.concatenate(samples, axis=1)[:, :, 0].T
    np.testing.assert_allclose(prof.estimate(top1_TL, 1), ref.estimate(top1_TL, 1))
    # the estimate over the profiled tokens themselves is exactly their layer-1 counts
    counts = np.bincount(np.concatenate(samples, axis=1)[1].reshape(-1), minlength=4)
    np.testing.assert_allclose(prof.estimate(top1_TL, 1), counts)
    # `moebal eval`: the run's model on 2 gloo ranks under every policy gives the static run's logits bit for bit
    r = moebal("eval", str(out), "--nproc", "2", "--profile", str(tmp_path / "p.npz"), "--batches", "1",
               "--top-k", "1", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(res[p]["equal_static"] for p in ("lina", "phase1", "oracle")), res
    assert len({res[p]["val_loss"] for p in ("static", "lina", "phase1", "oracle")}) == 1
    # one policy runs after static, so its check is made (it once printed "equal static: False" with no static run)
    r = moebal("eval", str(out), "--nproc", "2", "--profile", str(tmp_path / "p.npz"), "--batches", "1",
               "--top-k", "1", "--policy", "lina")
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.strip().splitlines()] == ["static", "lina"], r.stdout
    assert "logits equal static: True" in r.stdout, r.stdout
    # the served k's own profile: the first choice of every recorded token
    r = moebal("paths", str(out), "-o", str(tmp_path / "p1.npz"), "--top-k", "1")
    assert r.returncode == 0 and json.loads(r.stdout)["top_k"] == 1, r.stderr
    np.testing.assert_array_equal(PathProfile.load(tmp_path / "p1.npz").estimate(top1_TL, 1),
                                  build_profile([s[:, :, :1] for s in samples], 4, 3).estimate(top1_TL, 1))
    r = moebal("paths", str(out), "-o", str(tmp_path / "p3.npz"), "--top-k", "3")
    assert r.returncode == 2 and "--top-k must be in 1..2" in r.stderr, r.stderr
    # refused before any rank starts: experts that 3 ranks cannot share; an empty profile file
    r = moebal("eval", str(out), "--nproc", "3", "--policy", "static")
    assert r.returncode == 2 and "4 experts cannot be spread evenly over 3 ranks" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "rank 0 failed" not in r.stderr, r.stderr
    (tmp_path / "empty.npz").write_bytes(b"")
    r = moebal("eval", str(out), "--nproc", "2", "--profile", str(tmp_path / "empty.npz"), "--policy", "lina")
    assert r.returncode == 2 and "not a path profile" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # a profile of another model (3 MoE layers against 2): refused before any rank starts, in eval and generate
    build_profile([np.concatenate([samples[0], samples[0][:1]])], 4, 2).save(tmp_path / "three.npz")
    for cmd in (("eval", str(out)), ("generate", str(out), "--prompt", "def ", "--max-new-tokens", "2")):
        r = moebal(*cmd, "--nproc", "2", "--profile", str(tmp_path / "three.npz"), "--policy", "lina")
        assert r.returncode == 2 and "describes 3 layers of 4 experts; the model has 2 MoE layers" in r.stderr, r
        assert "Traceback" not in r.stderr and "rank 0 failed" not in r.stderr, r.stderr
    # a too-small --num-experts (the routing holds ids up to 3) and a bad --batch-size: errors, not tracebacks
    r = moebal("paths", str(out), "-o", str(tmp_path), "--path-len", "2")
    assert r.returncode == 2 and "is a folder: give a file path" in r.stderr, r.stderr
    r = moebal("paths", str(out), "-o", str(tmp_path / "p2.npz"), "--num-experts", "2")
    assert r.returncode == 2 and "--num-experts 4 or more" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = moebal("eval", str(out), "--batch-size", "-2", "--policy", "static")
    assert r.returncode == 2 and "--batch-size must be >= 1" in r.stderr, r.stderr


def test_paths_errors_are_clear(tmp_path: Path) -> None:
    r = moebal("paths", str(tmp_path))
    assert r.returncode == 2 and "train.record_routing_every" in r.stderr and "Traceback" not in r.stderr
    r = moebal("paths", str(tmp_path / "typo"))  # a wrong path is named as such, not "train with ..."
    assert r.returncode == 2 and "is not a directory" in r.stderr and "record_routing_every" not in r.stderr
    r = moebal("train", *TINY, "train.record_routing_every=-1", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "record_routing_every" in r.stderr
    r = moebal("eval", str(tmp_path))
    assert r.returncode == 2 and "config.yaml" in r.stderr and "Traceback" not in r.stderr
    # a sample cut short (a run killed while writing it, before samples were written whole) or of another shape
    (tmp_path / "routing").mkdir()
    import numpy as np

    np.savez_compressed(tmp_path / "routing" / "step_000002.npz", ids_LTK=np.zeros((2, 3), dtype=np.int16))
    (tmp_path / "routing" / "step_000001.npz").write_bytes(b"PK\x03\x04 cut short")
    for step, said in ((1, "BadZipFile"), (2, "of shape (2, 3)")):
        r = moebal("paths", str(tmp_path))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"step_00000{step}.npz is not a routing sample (" in r.stderr and said in r.stderr, r.stderr
        (tmp_path / "routing" / f"step_00000{step}.npz").unlink()


def test_eval_names_a_converted_weights_directory(tmp_path: Path) -> None:
    """`moebal eval` reads a training run; a `moebal convert hf-to-moebal` output (config.yaml beside
    hf_config.json, no checkpoint) gets the way to start a run from it instead of "no checkpoint"."""
    from moebal.config import Config, dump

    dump(Config(), tmp_path / "config.yaml")
    (tmp_path / "hf_config.json").write_text("{}", encoding="utf-8")
    r = moebal("eval", str(tmp_path), "--nproc", "2", "--policy", "static")
    assert r.returncode == 2, r.stderr
    assert "a converted weights directory, not a training run" in r.stderr and "hf.init_from=" in r.stderr
    assert "Traceback" not in r.stderr


SERVED = {  # per scheme, settings under which its validation differs from the plain model's
    # a padded validation row (documents; 19 real tokens of 48): served without its real tokens, padding took routed
    # slots the validation gives them (1.3e-4 relative apart)
    "mod": ["dynamism.mod.capacity=0.5", "data.samples=documents", "data.seq_len=48"],
    "early_exit": ["model.n_layers=4", "dynamism.early_exit.threshold=0.9"],
    "sparse_attention": ["dynamism.sparse_attention.block=8", "dynamism.sparse_attention.budget=random_walk",
                         "dynamism.sparse_attention.min_density=0.2", "dynamism.sparse_attention.max_density=0.5",
                         "dynamism.sparse_attention.costs=given"],
}


def _plain_val_loss(model, batches) -> float:
    """The mean loss of `batches` through `model`'s plain forward (the class's, not a scheme's served one)."""
    import torch

    model.model.__dict__.pop("forward")
    with torch.no_grad():
        return sum(model(b.ids_BT, b.labels_BT).loss.item() for b in batches) / len(batches)


@pytest.mark.parametrize("scheme", list(SERVED))
def test_eval_serves_a_scheme_s_run_as_its_training_validated_it(tmp_path: Path, scheme: str) -> None:
    """A run whose scheme changes its outputs (Mixture-of-Depths' routed layers, early exits, block-sparse attention)
    is served through the scheme at the checkpoint's step and state (`Dynamism.serve`): `moebal eval` on 2
    expert-parallel ranks gives the trainer's own validation loss of the same checkpoint and batches (its one-stage
    pipeline's forward), says how it served the model, oracle placement equals static bit for bit, the plain model
    gives another loss, and Lina, which plans from token paths that skipped or exited tokens break, is refused in a
    line for the two schemes whose layers run a subset of the tokens."""
    out = tmp_path / "run"
    tiny = [x for x in TINY if not x.startswith(("train.steps=", "train.eval_every=", "train.ckpt_every="))]
    r = moebal("train", "--out", str(out), *tiny, "train.steps=3", "train.eval_every=3", "train.ckpt_every=3",
               "parallel.nproc=1", f"dynamism.scheme={scheme}", *SERVED[scheme])
    assert r.returncode == 0, r.stderr
    trained = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    # the run's own validation batches by default (train.eval_batches 2; the default was 4 batches, other samples)
    r = moebal("eval", str(out), "--nproc", "2", "--policy", "oracle", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["served"]["scheme"] == scheme and res["served"]["step"] == 3 and res["oracle"]["equal_static"], res
    assert abs(res["static"]["val_loss"] - trained["val_loss"]) <= 1e-5 * trained["val_loss"], \
        (res["static"]["val_loss"], trained["val_loss"])
    if scheme == "mod":
        assert trained["mod_capacity"] == res["served"]["mod_capacity"] == 0.5
    elif scheme == "early_exit":
        assert min(trained["survival"]) < 1 and "exceeds 0.9" in res["served"]["line"], (trained, res)
    else:  # the densities the validation ran at: the next step's, which the checkpoint holds
        assert max(trained["attention_density"]) <= 0.5 and "block-sparse attention" in res["served"]["line"]
    from moebal.commands.eval import load_run_model
    from moebal.data import build_data, eval_batches

    cfg, model, served = load_run_model(out)
    assert served is not None and served.line == res["served"]["line"]
    batches = eval_batches(build_data(cfg).corpus.val, cfg.data.samples, cfg.data.seq_len, cfg.data.batch_size, 2)
    assert abs(_plain_val_loss(model, batches) - trained["val_loss"]) > 1e-4
    r = moebal("eval", str(out), "--nproc", "2", "--policy", "static", "--batches", "1")
    assert r.returncode == 0 and "served as the run validated after step 3: " in r.stdout, r.stdout
    if scheme != "sparse_attention":
        r = moebal("eval", str(out), "--nproc", "2", "--policy", "lina")
        assert r.returncode == 2 and f"trained with dynamism scheme {scheme}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_eval_of_a_bf16_run_computes_under_its_autocast(tmp_path: Path) -> None:
    """A bf16 run validated under bf16 autocast: `moebal eval` on 2 expert-parallel ranks computes as it did by
    default (`--precision run`) and gives its validation loss (equal here); `--precision fp32` serves the fp32
    weights in fp32, another loss (3e-5 relative apart on this model)."""
    out = tmp_path / "run"
    tiny = [x for x in TINY if not x.startswith(("train.steps=", "train.eval_every=", "train.ckpt_every=",
                                                 "train.precision="))]
    r = moebal("train", "--out", str(out), *tiny, "train.steps=3", "train.eval_every=3", "train.ckpt_every=3",
               "parallel.nproc=1", "train.precision=bf16")
    assert r.returncode == 0, r.stderr
    trained = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]["val_loss"]
    served = {}
    for precision in ("run", "fp32"):
        r = moebal("eval", str(out), "--nproc", "2", "--policy", "oracle", "--json", "--precision", precision)
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout.strip().splitlines()[-1])
        assert res["oracle"]["equal_static"], res
        served[res["precision"]] = res["static"]["val_loss"]
    assert abs(served["bf16"] - trained) <= 1e-6 * trained, (served, trained)
    assert abs(served["fp32"] - trained) > 1e-6 * trained, (served, trained)


def test_eval_loss_of_padded_documents_counts_the_labelled_tokens(tmp_path: Path) -> None:
    """`data.samples: documents` pads each batch's rows with label -100: `moebal eval`'s validation loss is the mean
    over the labelled tokens, the trainer's own validation loss of the same checkpoint and batches (it once divided
    by every position, padding included)."""
    out = tmp_path / "run"
    tiny = [x for x in TINY if not x.startswith(("train.steps=", "train.eval_every=", "train.ckpt_every="))]
    r = moebal("train", "--out", str(out), *tiny, "train.steps=2", "train.eval_every=2", "train.ckpt_every=2",
               "parallel.nproc=1", "data.samples=documents")
    assert r.returncode == 0, r.stderr
    trained = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    r = moebal("eval", str(out), "--nproc", "2", "--policy", "static", "--batches", "2", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["served"] is None
    assert abs(res["static"]["val_loss"] - trained["val_loss"]) <= 1e-5 * trained["val_loss"], \
        (res["static"]["val_loss"], trained["val_loss"])


def test_eval_serves_every_row_of_a_validation_split_shorter_than_a_batch(tmp_path: Path) -> None:
    """A validation split of 3 rows (batch size 4) on 2 ranks: split 2 + 1, every row served, the run's own
    validation loss (it once kept the 2 rows that split evenly, 3.4e-4 relative off, without a word)."""
    out = tmp_path / "run"
    tiny = [x for x in TINY if not x.startswith(("train.steps=", "train.eval_every=", "train.ckpt_every="))]
    r = moebal("train", "--out", str(out), *tiny, "train.steps=2", "train.eval_every=2", "train.ckpt_every=2",
               "parallel.nproc=1", "data.val_fraction=0.0004")
    assert r.returncode == 0, r.stderr
    trained = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]["val_loss"]
    r = moebal("eval", str(out), "--nproc", "2", "--policy", "static", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert abs(res["static"]["val_loss"] - trained) <= 1e-6 * trained, (res["static"]["val_loss"], trained)
