"""Trainer pieces: schedule, optimizer groups, the default preset, one short run's outputs."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time

import numpy as np
import pytest
import torch

from moebal.config import CONFIG_DIR, Config, ConfigError, TrainConfig, dump, with_overrides
from moebal.train import Hook, Trainer, lr_at
from moebal.train.optim import build_optimizer, param_groups
from moebal.train.progress import Progress

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
        "model.max_seq_len=64", "moe.num_experts=4", "moe.top_k=2", "moe.expert_ffn_dim=64", "data.seq_len=32",
        "data.batch_size=4", "data.max_bytes=300000", "train.steps=6", "train.warmup_steps=2",
        "train.eval_every=3", "train.eval_batches=2", "train.ckpt_every=0", "train.progress=plain",
        "train.precision=fp32", "train.threads=2"]


def tiny(*extra: str) -> Config:
    return with_overrides(Config(), [*TINY, *extra])


def test_default_yaml_is_exactly_the_dump_of_the_defaults():
    assert (CONFIG_DIR / "default.yaml").read_text(encoding="utf-8") == dump(Config())


def test_schedule_warms_up_then_decays_by_cosine_to_the_floor():
    t = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, t) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(1e-4)
    mid = 10 + (99 - 10) / 2
    assert lr_at(int(mid), t) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 10) / 89)))
    assert lr_at(0, TrainConfig(steps=5, lr=2.0, warmup_steps=0, min_lr_ratio=0.5)) == 2.0
    # one step after the warm-up is the last: at the floor, as wsd's (cosine and linear ran it at the peak)
    for schedule in ("cosine", "linear", "wsd"):
        one = TrainConfig(steps=5, lr=1.0, warmup_steps=4, min_lr_ratio=0.1, schedule=schedule)
        assert [round(lr_at(s, one), 6) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 0.1], schedule


def test_a_run_that_never_leaves_its_warm_up_says_so(tmp_path):
    """`train.warmup_steps` >= `train.steps` (a short run under the default 30): one line at start, how far the
    learning rate rises; nothing when the schedule completes."""
    from moebal.commands.train import warmup_note
    from tests.cli_util import run_cli

    assert warmup_note(TrainConfig(steps=4, warmup_steps=30)).startswith(
        "train.warmup_steps 30 > train.steps 4: the learning rate stays in its warm-up, rising to 0.133 x train.lr")
    assert warmup_note(TrainConfig(steps=30, warmup_steps=30)) is None  # it reaches train.lr at the last step
    assert warmup_note(TrainConfig(steps=4, warmup_steps=0)) is None
    tiny = [x for x in TINY if not x.startswith(("train.steps=", "train.warmup_steps="))]
    r = run_cli("train", "--out", str(tmp_path / "run"), *tiny, "train.steps=2", "train.warmup_steps=5",
                "parallel.nproc=1")
    assert r.returncode == 0 and "moebal train: train.warmup_steps 5 > train.steps 2" in r.stderr, r.stderr


def test_linear_constant_and_wsd_schedules_and_extending_a_wsd_run_keeps_its_stable_steps():
    lin = TrainConfig(steps=11, lr=1.0, warmup_steps=1, min_lr_ratio=0.1, schedule="linear")
    assert [round(lr_at(s, lin), 6) for s in (0, 1, 6, 10, 12)] == [1.0, 1.0, 0.5, 0.1, 0.1]
    assert all(lr_at(s, TrainConfig(steps=10, lr=0.5, warmup_steps=2, schedule="constant")) == 0.5
               for s in range(2, 15))
    wsd = TrainConfig(steps=12, lr=1.0, warmup_steps=2, min_lr_ratio=0.1, schedule="wsd", decay_fraction=0.3)
    lrs = [lr_at(s, wsd) for s in range(12)]  # 10 steps after the warm-up: the last 3 decay
    assert lrs[:2] == [0.5, 1.0] and lrs[2:9] == [1.0] * 7
    assert lrs[9:] == pytest.approx([0.7, 0.4, 0.1])
    longer = dataclasses.replace(wsd, steps=40)
    assert [lr_at(s, longer) for s in range(9)] == lrs[:9]  # the stable steps trained so far are unchanged
    assert lr_at(0, TrainConfig(steps=3, warmup_steps=0, schedule="wsd", decay_fraction=0.01)) == 2e-3  # >= 1 step
    assert lr_at(2, TrainConfig(steps=3, warmup_steps=0, schedule="wsd", decay_fraction=0.01, lr=1.0,
                                min_lr_ratio=0.0)) == 0.0
    with pytest.raises(ConfigError, match="train.decay_fraction"):
        tiny("train.decay_fraction=0")


def test_a_resume_says_when_its_schedule_does_not_continue_the_checkpoint_s_curve():
    from moebal.train.optim import schedule_change

    wsd = TrainConfig(steps=12, lr=1.0, warmup_steps=2, min_lr_ratio=0.1, schedule="wsd", decay_fraction=0.3)
    longer = dataclasses.replace(wsd, steps=40)
    assert schedule_change(wsd, wsd, 10) is None
    assert schedule_change(wsd, longer, 5) is None  # extended in its stable phase: the curve goes on
    line = schedule_change(wsd, longer, 11)  # after two decay steps: back up to lr
    assert line == ("the learning-rate schedule differs from the checkpoint's run (train.steps 12 -> 40): step 11 "
                    "trained at lr 0.4, where this schedule has 1, and step 12 runs at 1")
    cos = TrainConfig(steps=100, lr=1.0, warmup_steps=10)
    assert "train.steps 100 -> 200" in schedule_change(cos, dataclasses.replace(cos, steps=200), 50)
    assert "train.lr 1.0 -> 0.5" in schedule_change(cos, dataclasses.replace(cos, lr=0.5), 50)
    const = TrainConfig(steps=10, lr=0.5, warmup_steps=2, schedule="constant")
    assert schedule_change(const, dataclasses.replace(const, steps=30), 10) is None


def test_resuming_an_ended_wsd_run_with_more_steps_says_its_lr_jumps(tmp_path, capsys):
    from moebal.cli import main

    run = ["train", "--nproc", "1", "--out", str(tmp_path), *TINY, "train.eval_every=0", "train.ckpt_every=1",
           "train.schedule=wsd", "train.warmup_steps=1", "train.steps=3"]
    assert main(run) == 0
    capsys.readouterr()
    assert main(["train", "--nproc", "1", "--out", str(tmp_path), "--resume", "--steps", "5"]) == 0
    err = capsys.readouterr().err
    assert "the learning-rate schedule differs from the checkpoint's run (train.steps 3 -> 5): step 3 trained at " \
           "lr 0.0002, where this schedule has 0.002, and step 4 runs at 0.002" in err, err


def test_adam_eps_is_the_config_s_and_a_resume_takes_the_new_config_s(tmp_path):
    """`train.adam_eps` reaches AdamW (1e-8 by default, torch's); a resume builds its optimizer from its own config
    and loads only the state, so another epsilon (or betas) applies from the resumed step on; 0 is refused."""
    from moebal.commands.train import build_trainer
    from moebal.models import build_model

    assert build_optimizer(build_model(tiny()), TrainConfig()).defaults["eps"] == 1e-8
    first = build_trainer(tiny("train.steps=2", "train.ckpt_every=2", "train.eval_every=0"), tmp_path / "a",
                          False, False)
    first.train()
    again = build_trainer(tiny("train.steps=3", "train.eval_every=0", "train.adam_eps=1e-3", "train.beta1=0.8"),
                          tmp_path / "b", str(tmp_path / "a" / "ckpt-0000002"), False)
    assert again.step == 2 and len(again.strategy.optimizer.state) > 0  # the moments were loaded
    assert {(g["eps"], g["betas"]) for g in again.strategy.optimizer.param_groups} == {(1e-3, (0.8, 0.95))}
    with pytest.raises(ConfigError, match="train.adam_eps"):
        tiny("train.adam_eps=0")


def test_a_resume_names_the_settings_it_changes(tmp_path, capsys):
    """A resume's overrides that change the maths from the next step on (routing, precision, the optimizer's
    epsilon) are listed in a line; its length, logging and layout are not; a plain resume says nothing."""
    from moebal.cli import main

    run = ["train", "--nproc", "1", "--out", str(tmp_path), *TINY, "train.eval_every=0", "train.ckpt_every=1",
           "train.steps=2"]
    assert main(run) == 0
    capsys.readouterr()
    assert main(["train", "--nproc", "1", "--out", str(tmp_path), "--resume", "--steps", "3", "moe.top_k=1",
                 "train.adam_eps=1e-6", "train.threads=1"]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if "other than the checkpoint's" in x]
    assert lines == ["moebal train: resumed with settings other than the checkpoint's, from the next step on: "
                     "moe.top_k 2 -> 1, train.adam_eps 1e-08 -> 1e-06"], lines
    assert main(["train", "--nproc", "1", "--out", str(tmp_path), "--resume", "--steps", "4"]) == 0
    assert "other than the checkpoint's" not in capsys.readouterr().err


def test_no_weight_decay_on_norms_biases_and_vectors():
    from moebal.models import build_model

    model = build_model(tiny())
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert any("norm" in names[id(p)] for p in no_decay["params"])
    assert any("experts.w1" in names[id(p)] for p in decay["params"])
    assert sum(len(g["params"]) for g in build_optimizer(model, TrainConfig()).param_groups) == \
        len(list(model.parameters()))


class Recorder(Hook):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.layers_seen = 0

    def before_step(self, trainer, step):
        self.calls.append(f"before{step}")

    def after_backward(self, trainer, step):
        assert all(p.grad is not None for p in trainer.model.parameters() if p.requires_grad)
        self.calls.append(f"backward{step}")

    def after_step(self, trainer, step, stats, record):
        self.layers_seen = len(stats)
        record["hook_saw"] = int(sum(int(s.tokens) for s in stats))


def test_short_run_writes_metrics_checkpoint_dashboard_and_calls_hooks(tmp_path):
    hook = Recorder()
    cfg = tiny("moe.adaptive_threshold=0.3", "moe.bias_update_rate=0.01")
    trainer = Trainer(cfg, tmp_path, hooks=[hook])
    bias_before = [layer.expert_bias.clone() for layer in trainer.moe_layers()]
    result = trainer.train()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["ckpt-0000006", "config.yaml", "dashboard.svg", "kernels.json", "metrics.jsonl"]
    # the run's config: the given one with parallel.shard auto settled (one process: nothing to shard)
    settled = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, shard="none"))
    assert trainer.cfg == settled and (tmp_path / "config.yaml").read_text(encoding="utf-8") == dump(settled)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    for r in lines:
        for key in ("loss", "aux_loss", "lr", "tokens_per_s", "grad_norm", "load_max", "load_mean",
                    "load_imbalance", "dropped", "multi_expert_share", "expert_counts"):
            assert key in r, key
        assert len(r["load_imbalance"]) == 2 and r["hook_saw"] == 2 * 4 * 32
        assert all(0.0 <= s <= 1.0 for s in r["multi_expert_share"])
        assert sum(r["expert_counts"][0]) == r["load_mean"][0] * 4
    assert [r["step"] for r in lines if "val_loss" in r] == [3, 6]
    assert lines[-1]["val_loss"] == result.val_loss and result.steps == 6 and result.tokens == 6 * 4 * 32
    assert hook.calls[:3] == ["before1", "backward1", "before2"] and hook.layers_seen == 2
    # the auxiliary-loss-free bias moved (once per step, from the step's counts)
    assert any(not torch.equal(a, layer.expert_bias) for a, layer in zip(bias_before, trainer.moe_layers()))
    svg = (tmp_path / "dashboard.svg").read_text()
    assert "MoE layer 0: load / mean" in svg and "validation" in svg and "unigram entropy" in svg


def test_validation_leaves_the_rng_and_the_model_mode_alone(tmp_path):
    trainer = Trainer(tiny("moe.jitter=0.1"), tmp_path)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    loss = trainer.evaluate()
    assert loss is not None and math.isfinite(loss)
    assert torch.equal(torch.get_rng_state(), state) and trainer.model.training


def test_progress_plain_lines_and_bar(capsys):
    import io

    buf = io.StringIO()
    p = Progress(40, mode="plain", stream=buf)
    for s in range(1, 41):
        p.update(s, 2.0, 1000.0, val_loss=1.5 if s == 7 else None)
    p.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 21 and lines[-1].startswith("step 40/40 loss 2.000 val 1.500")
    bar = io.StringIO()
    b = Progress(10, mode="bar", stream=bar)
    b.update(10, 1.0, 10.0)
    b.close()
    assert bar.getvalue().startswith("\r[" + "#" * 24 + "]") and bar.getvalue().endswith("\n")


def test_time_limit_stops_early_like_a_finished_run_and_resume_finishes(tmp_path):
    cfg = tiny("train.time_limit_min=1e-6")  # already over when the first step ends
    result = Trainer(cfg, tmp_path).train()
    assert result.steps == 1 and result.stopped_early and "time_limit_min" in result.stopped_early
    assert result.val_loss is not None
    assert {"ckpt-0000001", "dashboard.svg", "metrics.jsonl"} <= {p.name for p in tmp_path.iterdir()}
    finished = Trainer(with_overrides(cfg, ["train.time_limit_min=null"]), tmp_path, resume=True).train()
    assert finished.steps == 6 and finished.stopped_early is None


def test_the_step_time_includes_the_hooks_work(tmp_path):
    """`step_time_s` and `tokens_per_s` count the hooks' work around the step (expert placement's Trans before it,
    its planner after), as a pipeline's step time does; they left it out."""

    class Slow(Hook):
        def before_step(self, trainer, step):
            time.sleep(0.05)

        def after_step(self, trainer, step, stats, record):
            time.sleep(0.05)

    trainer = Trainer(tiny("train.steps=2", "train.eval_every=0"), tmp_path, hooks=[Slow()])
    trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert all(r["step_time_s"] >= 0.1 for r in lines), lines
    assert trainer.train_seconds >= 0.2


def test_a_resumed_run_s_result_is_the_uninterrupted_run_s(tmp_path):
    """The result's figures over the last tenth of the steps (train loss, load imbalance) span a resume inside that
    tenth: they were those of the steps run since the resume."""
    cfg = tiny("train.steps=20", "train.eval_every=0")
    whole = Trainer(cfg, tmp_path / "whole").train()
    Trainer(cfg, tmp_path / "cut").train(stop_after=19)
    resumed = Trainer(cfg, tmp_path / "cut", resume=True).train()
    assert (resumed.steps, resumed.train_loss) == (20, whole.train_loss)
    assert resumed.load_imbalance == whole.load_imbalance


def test_a_resume_cuts_every_log_and_routing_sample_of_the_discarded_steps(tmp_path):
    """The lines and files of steps after the checkpoint go: metrics and plans, this rank's comm log and those of
    ranks the job no longer has (a 2-rank run resumed in one process), and routing samples the resumed run does
    not write again."""
    cfg = tiny("train.steps=4", "train.ckpt_every=2", "train.eval_every=0")
    Trainer(cfg, tmp_path).train()
    (tmp_path / "comm").mkdir()
    for r in (0, 1):
        (tmp_path / "comm" / f"rank{r}.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 5)))
    (tmp_path / "plans.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 5)))
    (tmp_path / "routing").mkdir()
    for s in (2, 4):
        np.savez(tmp_path / "routing" / f"step_{s:06d}.npz", ids_LTK=np.zeros((1, 1, 1), np.int16))
    shutil.rmtree(tmp_path / "ckpt-0000004")  # the job died after step 4's lines, before its checkpoint
    Trainer(with_overrides(cfg, ["train.steps=3"]), tmp_path, resume=True).train()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    for name in ("comm/rank0.jsonl", "comm/rank1.jsonl", "plans.jsonl"):
        assert [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()] == [1, 2], name
    assert sorted(p.name for p in (tmp_path / "routing").iterdir()) == ["step_000002.npz"]


def test_a_restarted_rank_counts_the_time_limit_from_the_job_s_start(tmp_path, monkeypatch):
    """A rank whose launcher started the job 2 minutes ago (a restart) has used that time of a 1-minute limit."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MOEBAL_JOB_START", str(time.time() - 120.0))
    result = Trainer(tiny("train.time_limit_min=1"), tmp_path).train()
    assert result.steps == 1 and result.stopped_early and "time_limit_min=1" in result.stopped_early
    monkeypatch.setenv("MOEBAL_JOB_START", str(time.time()))  # a fresh job: the limit is far off
    assert Trainer(tiny("train.time_limit_min=1"), tmp_path / "fresh").train().stopped_early is None


def test_accumulated_micro_batches_weigh_by_tokens_and_one_without_labels_adds_nothing(tmp_path):
    """4 rows, the last two without a label: 2 micro-batches give the one-pass loss (the empty one weighs 0, its
    mean-over-nothing is not a NaN in the loss or the gradients) and the same gradients within 1e-6 (no
    balancing loss: its per-forward form is another loss)."""
    from moebal.data import Batch

    grads, losses = [], []
    for A in (1, 2):
        trainer = Trainer(tiny(f"train.grad_accum={A}", "data.batch_size=4", "moe.aux_loss_coef=0"),
                          tmp_path / f"a{A}")
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (4, 16), generator=g)
        labels = ids.roll(-1, dims=1)
        labels[2:] = -100
        labels[1, :5] = -100  # the micro-batches' token counts differ: 16 + 11 and 0
        batch = Batch(ids, labels, int((labels != -100).sum()))
        loss, aux, _ = trainer.strategy.forward_backward(trainer, 1, batch, 1.0)
        losses.append(float(loss))
        grads.append(torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters() if p.grad is not None]))
    assert trainer.strategy.describe() == "one process, 2 micro-batches per step"
    assert math.isfinite(losses[1]) and losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert torch.isfinite(grads[1]).all() and grads[0].shape == grads[1].shape
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 1e-6
