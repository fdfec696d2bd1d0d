"""Bad steps (moebal/train/spikes.py): the spike test, and a rollback that skips the batches since the checkpoint
and trains on bit for bit as a resume from that checkpoint past those batches would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moebal.config import SpikeConfig
from moebal.errors import CheckpointError, ConfigError, DataError, TrainingError
from moebal.train import Hook, Trainer
from moebal.train.spikes import (
    INJECT_ENV,
    ROLLBACKS,
    InjectedSpike,
    Rollback,
    bad_step,
    injected_spike,
    read_rollbacks,
    replay_spikes,
    rollback_for,
    train_with_rollbacks,
)
from tests.cli_util import load_script, run_cli
from tests.unit.test_train import TINY, tiny

ROOT = Path(__file__).resolve().parents[2]
SPIKE = ["train.spike.factor=3", "train.spike.window=3", "train.ckpt_every=3", "train.keep_checkpoints=5",
         "train.steps=8", "train.eval_every=0"]


class Blow(Hook):
    """Scales every weight by 30 before step `at`: a real loss spike at that step."""

    name = "blow"

    def __init__(self, at: int) -> None:
        self.at = at

    def before_step(self, trainer, step):
        if step == self.at:
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.mul_(30.0)


def losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_bad_step_calls_non_finite_steps_and_spikes_against_the_median_of_the_window():
    sp = SpikeConfig(factor=2.0, window=3)
    assert bad_step(float("nan"), 1.0, [], sp)[0] == "diverged"
    assert bad_step(1.0, float("inf"), [], SpikeConfig())[0] == "diverged"
    assert bad_step(9.0, 1.0, [1.0, 1.0], sp) is None  # not yet a full window
    assert bad_step(4.0, 1.0, [0.1, 1.0, 2.0, 2.5], sp) is None  # the median of the last 3 is 2: 2.0x, not above
    kind, why = bad_step(4.0, 1.0, [0.1, 1.0, 2.0, 1.9], sp)  # ... and 1.9 here: 2.1x
    assert kind == "spiked" and "2.11x the median 1.9 of the previous 3 steps" in why
    assert bad_step(1e9, 1.0, [1.0] * 5, SpikeConfig()) is None  # factor 0: only non-finite steps are bad
    g = SpikeConfig(grad_factor=3.0, window=3)
    assert bad_step(1.0, 9.0, [1.0] * 3, g, [1.0, 4.0, 5.0]) is None  # the median of the norms is 4: 2.25x
    kind, why = bad_step(1.0, 9.0, [1.0] * 3, g, [0.1, 2.0, 2.5, 3.0])  # ... 2.5 here: 3.6x
    assert kind == "spiked" and why == ("the gradient norm 9 is 3.60x the median 2.5 of the previous 3 steps "
                                        "(train.spike.grad_factor 3.0)")
    assert bad_step(1.0, 9.0, [1.0] * 3, g, [1.0, 1.0]) is None and bad_step(1.0, 9.0, [1.0] * 3, g) is None
    assert bad_step(1.0, 1e9, [1.0] * 3, sp, [1.0] * 3) is None  # grad_factor 0: the loss test alone
    with pytest.raises(ConfigError, match="train.spike.grad_factor"):
        tiny("train.spike.grad_factor=1")
    with pytest.raises(ConfigError, match="train.spike.factor"):
        tiny("train.spike.factor=0.5")
    with pytest.raises(ConfigError, match="train.spike.window"):
        tiny("train.spike.window=0")


def test_a_gradient_norm_spike_is_called_from_the_checkpointed_norms(tmp_path):
    cfg = tiny(*SPIKE, "train.spike.factor=0", "train.spike.grad_factor=3")
    with pytest.raises(TrainingError, match=r"step 5: the gradient norm .*x the median .* "
                                            r"\(train.spike.grad_factor 3.0\): the loss spiked and stopped"):
        Trainer(cfg, tmp_path / "run", hooks=[Blow(at=5)]).train()
    norms = {r["step"]: r["grad_norm"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text()
                                                      .splitlines())}
    again = Trainer(cfg, tmp_path / "run", resume=True)
    assert again.step == 3 and again.norm_history == [norms[s] for s in (1, 2, 3)]
    assert norms[5] > 3 * sorted(norms[s] for s in (2, 3, 4))[1]


def test_a_replay_keeps_bad_steps_out_of_the_histories_and_needs_every_steps_line():
    recs = [{"step": i + 1, "loss": v, "grad_norm": g}
            for i, (v, g) in enumerate([(1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (10.0, 1.0), (10.0, 9.0), (1.0, 1.0),
                                        (float("nan"), 1.0)])]
    bad = replay_spikes(recs, SpikeConfig(factor=2.0, window=3))
    # step 5 is still 10x the median of steps 1-3: step 4's figures never entered the history
    assert [(s, k) for s, k, _ in bad] == [(4, "spiked"), (5, "spiked"), (7, "diverged")]
    assert [(s, k) for s, k, _ in replay_spikes(recs, SpikeConfig(grad_factor=3.0, window=3))] == [
        (5, "spiked"), (7, "diverged")]
    with pytest.raises(DataError, match=r"from step 2 to step 4: .*train.log_every=1"):
        replay_spikes([recs[0], recs[1], recs[3]], SpikeConfig(factor=2.0, window=3))


def test_a_replay_of_a_runs_metrics_calls_the_step_the_trainer_stopped_at(tmp_path):
    cfg = tiny(*SPIKE, "train.spike.factor=0", "train.spike.grad_factor=3")
    with pytest.raises(TrainingError) as stopped:
        Trainer(cfg, tmp_path / "run", hooks=[Blow(at=5)]).train()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    [(step, kind, why)] = replay_spikes(records, cfg.train.spike)
    assert (step, kind) == (5, "spiked") and why in str(stopped.value)
    # the loss test at the same window calls the same step, the script lists both
    assert [s for s, _, _ in replay_spikes(records, SpikeConfig(factor=3.0, window=3))] == [5]
    mod = load_script("spike_replay")
    out = tmp_path / "r.json"
    assert mod.main([str(tmp_path / "run"), "--factor", "3", "--grad-factor", "3", "--window", "3",
                     "--json", str(out)]) == 0
    res = json.loads(out.read_text())["runs"][0]
    assert [(x["test"], [b["step"] for b in x["bad"]]) for x in res["settings"]] == [("loss", [5]),
                                                                                     ("grad_norm", [5])]
    assert mod.main([str(tmp_path / "nothing")]) == 2


def test_a_spike_stops_the_run_without_saving_its_state(tmp_path):
    trainer = Trainer(tiny(*SPIKE), tmp_path, hooks=[Blow(at=5)])
    with pytest.raises(TrainingError, match="step 5: the loss .* the loss spiked and stopped") as e:
        trainer.train()
    assert not isinstance(e.value, Rollback) and "train.spike.action=rollback" in str(e.value)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-0000003"] and max(losses(tmp_path)) == 5
    assert not (tmp_path / ROLLBACKS).exists()


def test_a_rollback_skips_the_batches_since_the_checkpoint_and_trains_on_as_a_resume_past_them(tmp_path):
    run = tmp_path / "run"
    cfg = tiny(*SPIKE, "train.spike.action=rollback", "train.spike.skip_extra=1")
    first = Trainer(cfg, run, hooks=[Blow(at=5)])
    with pytest.raises(Rollback) as e:
        first.train()
    first.close()
    assert e.value.checkpoint == run / "ckpt-0000003" and "rolled back to" in str(e.value)
    (rec,) = read_rollbacks(run)
    assert rec["step"] == 5 and rec["resume_step"] == 3 and rec["skipped_batches"] == 3 and rec["skip_extra"] == 1
    assert rec["loss"] > 3 * sorted(losses(run)[s] for s in (2, 3, 4))[1]
    # the loss history went into the checkpoint: the resumed trainer can call a spike at its first step
    again = Trainer(cfg, run, resume=str(e.value.checkpoint))
    assert len(again.loss_history) == 3 and again.loss_history == [losses(run)[s] for s in (1, 2, 3)]
    result = again.train()
    assert result.steps == 8 and result.rollbacks == 1
    got = losses(run)
    assert sorted(got) == list(range(1, 9))  # the rolled-back steps' lines went with the rollback
    # reference: the checkpoint resumed elsewhere, three batches drawn and dropped by hand (steps 4 and 5, and
    # one more), then trained: the same losses bit for bit
    ref = Trainer(cfg, tmp_path / "ref", resume=str(run / "ckpt-0000003"))
    for _ in range(3):
        ref.data.train.next_samples()
    ref.train()
    want = losses(tmp_path / "ref")
    assert all(got[s] == want[s] for s in range(4, 9)), (got, want)
    # a restart from the same checkpoint (a crash after the rollback) skips the same batches
    crash = Trainer(cfg, run, resume=str(run / "ckpt-0000003"))
    crash.train()
    assert losses(run) == got
    # and without the skip the run would have trained other batches
    plain = Trainer(tiny(*SPIKE), tmp_path / "plain", resume=str(run / "ckpt-0000003"))
    plain.train()
    assert losses(tmp_path / "plain")[4] != got[4]


def test_a_rollback_goes_back_at_least_train_spike_back_steps_to_an_older_checkpoint(tmp_path):
    run = tmp_path / "run"
    cfg = tiny(*SPIKE, "train.spike.action=rollback", "train.ckpt_every=1", "train.spike.back=2",
               "train.keep_checkpoints=10")
    first = Trainer(cfg, run, hooks=[Blow(at=5)])
    with pytest.raises(Rollback) as e:
        first.train()
    first.close()
    assert e.value.checkpoint == run / "ckpt-0000003" and e.value.record["skipped_batches"] == 2  # not ckpt 4
    # ckpt 4 holds the abandoned line of the run: moved aside, so a restart (a crash right after the rollback,
    # --resume) takes ckpt 3 and its skipped batches, not ckpt 4 and the spike's batches again
    assert "the 1 checkpoint after it moved to" in str(e.value)
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-0000001", "ckpt-0000002", "ckpt-0000003"]
    assert (run / "rolled-back" / "1" / "ckpt-0000004" / "state.json").is_file()
    assert read_rollbacks(run)[0]["retired"] == ["rolled-back/1/ckpt-0000004"]
    restart = Trainer(cfg, run, resume=True)
    assert restart.step == 3
    restart.train()
    ref = Trainer(cfg, tmp_path / "ref", resume=str(run / "ckpt-0000003"))
    for _ in range(2):
        ref.data.train.next_samples()
    ref.train()
    got, want = losses(run), losses(tmp_path / "ref")
    assert all(got[s] == want[s] for s in range(4, 9)), (got, want)
    # none that old: the oldest, which pruning keeps beside the newest two while none is `back` steps older
    cfg = tiny(*SPIKE, "train.spike.action=rollback", "train.ckpt_every=1", "train.spike.back=50",
               "train.keep_checkpoints=2")
    with pytest.raises(Rollback) as e:
        Trainer(cfg, tmp_path / "few", hooks=[Blow(at=5)]).train()
    assert e.value.checkpoint == tmp_path / "few" / "ckpt-0000001"
    retired = read_rollbacks(tmp_path / "few")[0]["retired"]
    assert retired == ["rolled-back/1/ckpt-0000003", "rolled-back/1/ckpt-0000004"]
    # one checkpoint kept, but `back` reachable: pruning keeps one that old (ckpt 3 of 1-5) for the spike at step 6
    cfg = tiny(*SPIKE, "train.spike.action=rollback", "train.ckpt_every=1", "train.spike.back=2",
               "train.keep_checkpoints=1")
    with pytest.raises(Rollback) as e:
        Trainer(cfg, tmp_path / "one", hooks=[Blow(at=6)]).train()
    assert e.value.checkpoint == tmp_path / "one" / "ckpt-0000003" and e.value.record["skipped_batches"] == 3


def test_rollbacks_stop_at_their_maximum_and_a_second_one_to_the_same_checkpoint_skips_the_first_ones_too(tmp_path):
    cfg = tiny(*SPIKE, "train.spike.action=rollback", "train.spike.max_rollbacks=2", "train.ckpt_every=4")
    first = Trainer(cfg, tmp_path, hooks=[Blow(at=5)])
    with pytest.raises(Rollback):
        first.train()
    second = Trainer(cfg, tmp_path, resume=str(tmp_path / "ckpt-0000004"), hooks=[Blow(at=6)])
    with pytest.raises(Rollback) as e:
        second.train()
    assert e.value.record["skipped_batches"] == 1 + 2  # step 5's batch, then steps 5 and 6 after it
    third = Trainer(cfg, tmp_path, resume=str(tmp_path / "ckpt-0000004"), hooks=[Blow(at=5)])
    with pytest.raises(TrainingError, match=r"made its train.spike.max_rollbacks \(2\) rollbacks") as stop:
        third.train()
    assert not isinstance(stop.value, Rollback)
    assert [r["step"] for r in read_rollbacks(tmp_path)] == [5, 6]
    assert rollback_for(read_rollbacks(tmp_path), 4)["step"] == 6 and rollback_for(read_rollbacks(tmp_path), 3) is None


def test_a_damaged_rollback_record_is_refused_with_the_fix(tmp_path):
    (tmp_path / ROLLBACKS).write_text('{"step": 5}\n')
    with pytest.raises(CheckpointError, match="line 1 is not a rollback record .* delete the line"):
        read_rollbacks(tmp_path)


def test_resuming_a_run_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, capsys):
    """--resume-from an older checkpoint of the run: the newer ones would be what a later --resume continues (a
    crash before the run re-saves those steps), so they move to superseded/<n>/."""
    run = tmp_path / "run"
    cfg = tiny(*SPIKE, "train.ckpt_every=2", "train.steps=6")
    Trainer(cfg, run).train()
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-0000002", "ckpt-0000004", "ckpt-0000006"]
    Trainer(cfg, tmp_path / "other", resume=str(run / "ckpt-0000002"))  # another run's directory: left alone
    assert len(list(run.glob("ckpt-*"))) == 3 and not (run / "superseded").exists()
    Trainer(cfg, run, resume=str(run / "ckpt-0000006"))  # nothing left to train: nothing moves
    assert len(list(run.glob("ckpt-*"))) == 3
    # a resume that fails (a model the checkpoint does not fit) moves nothing: the run still resumes as it was
    with pytest.raises(CheckpointError):
        Trainer(tiny(*SPIKE, "train.ckpt_every=2", "train.steps=6", "model.dim=32"), run,
                resume=str(run / "ckpt-0000002"))
    assert len(list(run.glob("ckpt-*"))) == 3 and not (run / "superseded").exists()
    Trainer(cfg, run, resume=str(run / "ckpt-0000002"))
    assert "its 2 newer checkpoints moved to" in capsys.readouterr().err
    assert [p.name for p in run.glob("ckpt-*")] == ["ckpt-0000002"]
    assert sorted(p.name for p in (run / "superseded" / "1").iterdir()) == ["ckpt-0000004", "ckpt-0000006"]
    crashed = Trainer(cfg, run, resume=True)
    assert crashed.step == 2
    crashed.train()
    Trainer(cfg, run, resume=str(run / "ckpt-0000004"))  # a second time: a folder of its own
    assert [p.name for p in (run / "superseded" / "2").iterdir()] == ["ckpt-0000006"]


def test_the_injected_spike_is_read_from_the_environment_and_a_bad_value_is_one_line_with_the_fix():
    assert injected_spike({}) is None and injected_spike({INJECT_ENV: " "}) is None
    spike = injected_spike({INJECT_ENV: "5"})
    assert (spike.step, spike.scale) == (5, 30.0)
    spike = injected_spike({INJECT_ENV: "7:4.5"})
    assert (spike.step, spike.scale) == (7, 4.5)
    for bad in ("x", "0", "-2", "5:1", "5:0.5", "5:nan", "5:inf", "5:x", "5.5"):
        with pytest.raises(ConfigError, match=f"{INJECT_ENV}='{bad}': expected STEP or STEP:SCALE"):
            injected_spike({INJECT_ENV: bad})


def test_an_injected_spike_rolls_back_once_and_a_resume_with_the_record_trains_the_same_steps(tmp_path):
    """The hook is a real spike at its step, not again once the run directory records a rollback from it: the
    rebuilt trainer (it has the hook too, as `moebal train` builds every trainer) trains on. A resume of the
    checkpoint in another directory that holds the run's `rollbacks.jsonl` skips the same batches: the same
    losses bit for bit (what `scripts/compose_check.py --spike` compares across processes)."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    cfg = tiny(*SPIKE, "train.spike.action=rollback", "train.spike.skip_extra=1")
    result = train_with_rollbacks(Trainer(cfg, run, hooks=[InjectedSpike(5)]),
                                  lambda ckpt, d: Trainer(cfg, run, resume=str(ckpt), hooks=[InjectedSpike(5)]),
                                  lambda t: t.train())
    assert result.steps == 8 and result.rollbacks == 1
    (rec,) = read_rollbacks(run)
    assert rec["step"] == 5 and rec["resume_step"] == 3 and rec["loss"] > 3 * losses(run)[4]
    ref.mkdir()
    (ref / ROLLBACKS).write_text((run / ROLLBACKS).read_text())
    Trainer(cfg, ref, resume=str(run / "ckpt-0000003")).train()
    got, want = losses(run), losses(ref)
    assert sorted(want) == list(range(4, 9)) and all(got[s] == want[s] for s in want), (got, want)
    # a crash after the rollback: the restart from the same checkpoint, with the hook, trains the same steps
    Trainer(cfg, run, resume=str(run / "ckpt-0000003"), hooks=[InjectedSpike(5)]).train()
    assert losses(run) == got


def test_moebal_train_injects_the_spike_from_the_environment_and_refuses_a_bad_value(tmp_path):
    common = ["train", "--nproc", "1", *TINY, *SPIKE, "train.spike.action=rollback"]
    ran = run_cli(*common, "--out", str(tmp_path / "run"), env={INJECT_ENV: "5"})
    assert ran.returncode == 0, ran.stderr
    assert "step 5: the loss" in ran.stderr and "rolled back to" in ran.stderr
    assert [r["step"] for r in read_rollbacks(tmp_path / "run")] == [5]
    bad = run_cli(*common, "--out", str(tmp_path / "bad"), env={INJECT_ENV: "five"})
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"moebal train: error: {INJECT_ENV}='five': expected STEP or STEP:SCALE, a step of at least 1 and a scale "
        f"above 1 (every weight is multiplied by it before that step), e.g. {INJECT_ENV}=5 or {INJECT_ENV}=5:30; "
        f"unset it to train without the fault"]
    assert not (tmp_path / "bad").exists()
