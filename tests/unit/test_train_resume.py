"""Exact resume: N steps, stop, resume for N more == 2N uninterrupted steps, bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moebal.errors import CheckpointError
from moebal.train import Trainer
from moebal.train.checkpoint import find_checkpoints
from tests.unit.test_train import TINY, tiny

CASES = {
    # jitter and adaptive gating draw on the torch RNG and move the routing; the bias update is a buffer
    "packed-adaptive-bias-jitter": ["moe.adaptive_threshold=0.2", "moe.bias_update_rate=0.01", "moe.jitter=0.05"],
    "documents-capacity-bf16": ["data.samples=documents", "moe.capacity_factor=1.0", "train.precision=bf16"],
}


def _losses(run: Path) -> list[tuple[int, float, float | None]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    return [(r["step"], r["loss"], r.get("val_loss"), r["aux_loss"], r["grad_norm"]) for r in rows]


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_is_bitwise_identical(tmp_path, case):
    cfg = tiny(*CASES[case], "train.steps=8", "train.eval_every=3", "train.ckpt_every=0")
    whole = Trainer(cfg, tmp_path / "whole").train()
    first = Trainer(cfg, tmp_path / "split").train(stop_after=4)  # an interruption after step 4
    assert first.steps == 4 and [p.name for p in find_checkpoints(tmp_path / "split")] == ["ckpt-0000004"]
    assert not (tmp_path / "split" / "dashboard.svg").exists()
    resumed = Trainer(cfg, tmp_path / "split", resume=True).train()
    assert resumed.steps == 8
    assert _losses(tmp_path / "split") == _losses(tmp_path / "whole")  # every logged value, exactly
    assert resumed.val_loss == whole.val_loss and resumed.tokens == whole.tokens


def test_resume_discards_metrics_logged_after_the_checkpoint(tmp_path):
    cfg = tiny("train.steps=6", "train.ckpt_every=2", "train.keep_checkpoints=5")
    Trainer(cfg, tmp_path / "whole").train()
    run = tmp_path / "crashed"
    Trainer(cfg, run).train(stop_after=5)  # checkpoints at 2, 4 and 5
    shutil.rmtree(run / "ckpt-0000005")  # the crash came before the step-5 checkpoint
    Trainer(cfg, run, resume=True).train()
    assert [s for s, *_ in _losses(run)] == [1, 2, 3, 4, 5, 6]
    assert _losses(run) == _losses(tmp_path / "whole")


def test_resume_errors(tmp_path):
    cfg = tiny("train.steps=4", "train.ckpt_every=2")
    with pytest.raises(CheckpointError, match="nothing to resume"):
        Trainer(cfg, tmp_path / "empty", resume=True)
    Trainer(cfg, tmp_path / "run").train()
    latest = find_checkpoints(tmp_path / "run")[-1]
    (latest / "model-r00000.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"model-r00000.safetensors has 7 bytes.*previous good checkpoint is .*"
                                              r"ckpt-0000002"):
        Trainer(cfg, tmp_path / "run", resume=True)
    other = tiny("train.steps=4", "model.dim=32")
    with pytest.raises(CheckpointError, match="in the checkpoint but .* in this model"):
        Trainer(other, tmp_path / "run", resume=find_checkpoints(tmp_path / "run")[0])


def test_the_run_expert_kernel_is_recorded_and_kept_on_resume(tmp_path):
    """The kernel a run settled on at start-up is in kernels.json and in its checkpoints, and a resume keeps
    it even where auto's rule would now choose the other one (say, after an upgrade); an explicit
    moe.kernel wins over the record."""
    from moebal.config import with_overrides
    from moebal.train.checkpoint import _file_record

    cfg, run = tiny("train.steps=4", "train.eval_every=0"), tmp_path / "run"
    Trainer(cfg, run).train(stop_after=2)
    record = json.loads((run / "kernels.json").read_text(encoding="utf-8"))["experts"]
    assert (record["kernel"], record["source"], record["dtype"]) == ("loop", "auto", "float32")
    ckpt = find_checkpoints(run)[-1]
    state = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))
    assert state["kernels"] == record
    state["kernels"]["kernel"] = "grouped_mm"  # what the run chose before the interruption
    (ckpt / "state.json").write_text(json.dumps(state), encoding="utf-8")
    manifest = json.loads((ckpt / "manifest.json").read_text(encoding="utf-8"))
    manifest["files"]["state.json"] = _file_record(ckpt / "state.json")
    (ckpt / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")

    resumed = Trainer(cfg, run, resume=True)
    assert {layer.experts.kernel for layer in resumed.moe_layers()} == {"grouped_mm"}
    assert json.loads((run / "kernels.json").read_text(encoding="utf-8"))["experts"]["source"] == "checkpoint"
    resumed.train()
    assert json.loads((find_checkpoints(run)[-1] / "state.json").read_text())["kernels"]["kernel"] == "grouped_mm"
    forced = Trainer(with_overrides(cfg, ["moe.kernel=loop"]), run, resume=True)
    assert {layer.experts.kernel for layer in forced.moe_layers()} == {"loop"}
    assert forced.kernels is not None and forced.kernels["source"] == "config"


def test_every_rank_takes_rank_0s_expert_kernel():
    from moebal.models import build_model
    from moebal.train.kernels import settle_expert_kernel

    cfg = tiny()
    model = build_model(cfg)
    seen: list[dict] = []

    def gather(mine: dict) -> list[dict]:  # rank 1 of two: rank 0 decided on grouped_mm
        seen.append(mine)
        return [{"kernel": "grouped_mm", "source": "auto"}, mine]

    out = settle_expert_kernel(model, cfg, torch.device("cpu"), gather)
    assert seen == [{"kernel": "loop", "source": "auto"}]  # what this rank would have chosen alone
    assert out is not None and out["kernel"] == "grouped_mm"
    assert {layer.experts.kernel for layer in model.moe_layers()} == {"grouped_mm"}


def test_a_switch_to_or_from_mixture_of_depths_on_resume_names_the_scheme(tmp_path):
    """Mixture-of-Depths' routers are model parameters: a plain checkpoint resumed as mod lacks them, a mod one
    resumed as another scheme holds them; each is refused naming `dynamism.scheme` (it said "the model config")."""
    from moebal.cli import main
    from moebal.commands.train import build_trainer

    common = ["train", "--nproc", "1", "--steps", "2", "train.ckpt_every=2", "train.eval_every=0"]
    tiny_args = [x for x in TINY if not x.startswith(("train.steps=", "train.ckpt_every=", "train.eval_every="))]
    for scheme, other in (("none", "mod"), ("mod", "pruning")):
        src = tmp_path / scheme
        assert main([*common, "--out", str(src), *tiny_args, f"dynamism.scheme={scheme}"]) == 0
        cfg = tiny("train.steps=3", "train.eval_every=0", f"dynamism.scheme={other}")
        with pytest.raises(CheckpointError, match="dynamism.scheme cannot switch to or from mod on resume"):
            build_trainer(cfg, tmp_path / f"{scheme}-{other}", str(src / "ckpt-0000002"), False)
