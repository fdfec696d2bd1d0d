"""The split-backward benchmark runs and reports what it names (a smoke run on a one-layer stage)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_wgrad_split.py"


def test_quick_run_writes_cpu_times_and_the_w_share(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("bench_wgrad_split", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "w.json"
    assert mod.main(["--quick", "--tokens", "16", "--layers", "1", "--micro", "2", "--precision", "fp32",
                     "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    (row,) = rep["records"]
    assert rep["precision"] == "fp32" and row["tokens"] == 16 and row["repeats"] == 8
    assert 0.0 < row["w_cpu_s"] < row["split_backward_cpu_s"] < row["split_iteration_cpu_s"]
    assert 0.0 < row["w_share_of_backward"] < 1.0 and row["split_over_plain"] > 0.0
