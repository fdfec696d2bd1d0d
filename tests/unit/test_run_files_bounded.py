"""A long run's files are read within bounded memory: `MetricsLog.truncate_after` (on every resume) rewrites line by
line, the dashboard keeps per-layer expert counts on at most 2 x `HEATMAP_STEPS` records while reading and draws
at most `HEATMAP_STEPS` steps, the trainer's recent records keep only what its result reads, and routing samples
sort by step number past step 999,999."""

from __future__ import annotations

import json
import tracemalloc
import xml.etree.ElementTree as ET

from moebal.train.dashboard import HEATMAP_STEPS, read_dashboard_records, write_dashboard
from moebal.train.metrics import MetricsLog, read_metrics
from moebal.train.routing_log import routing_files
from moebal.train.trainer import RECENT_KEYS, Trainer
from tests.unit.test_train import tiny

NS = "{http://www.w3.org/2000/svg}"


def _big_log(path, lines: int, width: int) -> None:
    """`lines` records of steps 1.., each with a `width`-number payload (a real run's per-layer counts)."""
    with open(path, "w", encoding="utf-8") as f:
        for step in range(1, lines + 1):
            f.write(json.dumps({"step": step, "loss": 1.0, "counts": list(range(width))}, separators=(",", ":")))
            f.write("\n")
        f.write('{"step": 999, "loss"')  # a torn last line


def test_truncating_a_long_log_holds_one_line_at_a_time(tmp_path):
    path = tmp_path / "plans.jsonl"
    _big_log(path, 120, 40_000)  # 120 lines of about 230 kB: 28 MB of text, several times that parsed
    tracemalloc.start()
    try:
        MetricsLog.truncate_after(path, 100)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8e6, peak  # a few lines' worth, not the file's records
    records = read_metrics(path, keys=("step",))
    assert [r["step"] for r in records] == list(range(1, 101)) and records[0] == {"step": 1}
    assert path.read_text().endswith("\n") and not list(tmp_path.glob("*.tmp"))


def test_the_dashboard_thins_expert_counts_to_evenly_spaced_steps(tmp_path):
    n = 5 * HEATMAP_STEPS + 3
    path = tmp_path / "metrics.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for step in range(1, n + 1):
            f.write(json.dumps({"step": step, "loss": 2.0, "tokens": 7, "expert_counts": [[step, 1, 2, 3]]}) + "\n")
    records = read_dashboard_records(path)
    assert len(records) == n and all(set(r) <= {"step", "loss", "expert_counts"} for r in records)
    counted = [r["step"] for r in records if "expert_counts" in r]
    assert len(counted) <= 2 * HEATMAP_STEPS and counted[0] == 1
    assert len({b - a for a, b in zip(counted, counted[1:])}) == 1  # one stride: evenly spaced
    root = ET.parse(write_dashboard(records, tmp_path / "d.svg")).getroot()
    cells = [r for r in root.iter(f"{NS}rect") if r.get("height") and r.get("fill", "").startswith("#")]
    assert len(cells) <= 4 * HEATMAP_STEPS + 200  # 4 experts per drawn step, beside frames and the colour scale
    full = [{"step": s, "loss": 2.0, "expert_counts": [[s, 1, 2, 3]]} for s in range(1, n + 1)]
    root = ET.parse(write_dashboard(full, tmp_path / "e.svg")).getroot()  # given every record: thinned too
    assert len([r for r in root.iter(f"{NS}rect")]) <= 4 * HEATMAP_STEPS + 200


def test_the_trainer_keeps_only_what_its_result_reads_of_recent_steps(tmp_path):
    trainer = Trainer(tiny("train.steps=20"), tmp_path)
    result = trainer.train()
    assert len(trainer._recent) == 2 and all(set(r) <= set(RECENT_KEYS) for r in trainer._recent)
    assert {"loss", "load_imbalance"} <= set(trainer._recent[-1]) and result.load_imbalance


def test_routing_samples_sort_by_step_past_six_digits(tmp_path):
    folder = tmp_path / "routing"
    folder.mkdir()
    for step in (999_990, 1_000_000, 10, 1_000_010):
        (folder / f"step_{step:06d}.npz").write_bytes(b"")
    assert [p.name for p in routing_files(tmp_path)] == ["step_000010.npz", "step_999990.npz", "step_1000000.npz",
                                                         "step_1000010.npz"]
