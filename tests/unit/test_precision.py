"""train.precision auto: bf16 where the device computes it natively, fp32 elsewhere, settled once per run."""

from __future__ import annotations

import pytest
import torch

from moebal.config import load
from moebal.train import precision


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_the_device_and_explicit_values_are_kept(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(precision, "bf16_native", lambda device: native)
    cpu = torch.device("cpu")
    assert precision.compute_precision("auto", cpu) == ("bf16" if native else "fp32")
    assert precision.compute_precision("bf16", cpu) == "bf16" and precision.compute_precision("fp32", cpu) == "fp32"
    cfg = load(None, [])
    assert cfg.train.precision == "auto"
    resolved = precision.resolve_precision(cfg, cpu)
    assert resolved.train.precision == ("bf16" if native else "fp32")
    assert precision.uses_bf16(cfg, cpu) == native
    assert resolved.model == cfg.model and resolved.train.lr == cfg.train.lr  # nothing else changes
    explicit = load(None, ["train.precision=bf16"])
    assert precision.resolve_precision(explicit, cpu) is explicit


def test_the_cpu_answer_is_onednns() -> None:
    """On a CPU, auto means what oneDNN reports (AVX-512 or AMX: native bf16; AVX2: a slow fallback)."""
    assert precision.bf16_native(torch.device("cpu")) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_the_train_command_records_the_resolved_precision(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """config.yaml keeps bf16 or fp32, never auto: a resumed run on another machine computes alike."""
    import argparse

    from moebal.commands import train as train_cmd

    monkeypatch.setattr(train_cmd, "pick_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(precision, "bf16_native", lambda device: False)
    ap = argparse.ArgumentParser()
    train_cmd.add_arguments(ap)
    args = ap.parse_args(["--out", str(tmp_path / "run")])
    cfg, _ = train_cmd.resolve_config(args)
    assert cfg.train.precision == "fp32"
