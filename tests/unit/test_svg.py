"""moebal.train.svg: the run directory's charts as SVG, without a plotting library."""

from __future__ import annotations

import math
import subprocess
import sys
import xml.etree.ElementTree as ET

from moebal.train.dashboard import write_dashboard
from moebal.train.svg import Bars, Figure, HeatMap, Lines, nice_ticks

NS = "{http://www.w3.org/2000/svg}"


def test_nice_ticks_are_round_and_cover_the_range():
    assert nice_ticks(0, 10) == [0, 2.5, 5, 7.5, 10]
    ticks = nice_ticks(0.013, 0.087)
    assert all(0.013 <= t <= 0.087 for t in ticks) and len(ticks) >= 3
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:])}
    assert len(steps) == 1 and steps.pop() in (0.01, 0.02, 0.025, 0.05)
    assert nice_ticks(3.0, 3.0) == [3.0] and nice_ticks(math.nan, 1.0) == []


def test_a_figure_of_every_panel_kind_is_well_formed_svg(tmp_path):
    fig = Figure("a run", cols=2)
    lines = fig.add(Lines("loss", "step", "nats", span=2))
    lines.add([1, 2, 3, 4, 5], [3.0, 2.5, math.nan, 2.0, 1.8], "tab:blue", "train")
    lines.add([2, 4], [2.7, 2.1], "tab:orange", "validation", markers=True)
    lines.hline(2.2, "grey", "entropy")
    fig.add(HeatMap("layer 0", [1, 2, 3], [[1.0, 1.0], [1.5, 0.5], [2.0, 0.0]], ylabel="expert"))
    fig.add(Bars("gantt", ["stage 0", "stage 1"], [(0, 0.0, 1.0, "#9ecae1", "0"), (1, 1.0, 2.5, "#3182bd", "0")],
                 xlabel="seconds"))
    path = fig.write(tmp_path / "f.svg")
    assert not list(tmp_path.glob("*.tmp"))
    root = ET.parse(path).getroot()
    assert root.tag == f"{NS}svg"
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert {"a run", "loss", "layer 0", "gantt", "train", "validation", "entropy", "stage 0", "stage 1"} <= set(texts)
    # the NaN splits the train line in two; the validation line is one, with a marker per point
    assert len(list(root.iter(f"{NS}polyline"))) == 3 and len(list(root.iter(f"{NS}circle"))) == 2
    # 3 steps x 2 experts of cells, 20 of colour scale, 2 bars, and the panel frames
    fills = [r.get("fill") for r in root.iter(f"{NS}rect")]
    assert fills.count("#3182bd") == 1 and fills.count("#9ecae1") == 1
    assert len(fills) >= 1 + 6 + 20 + 2


def test_the_dashboard_has_a_heat_map_per_moe_layer_and_a_placement_panel(tmp_path):
    recs = [{"step": i, "loss": 5.0 - 0.1 * i, "expert_counts": [[i, 10 - i, 5, 5], [4, 4, 4, 4]],
             "rank_imbalance_before": [1.5, 1.4], "rank_imbalance_after": [1.1, 1.05]} for i in range(1, 9)]
    recs[3]["val_loss"] = 4.4
    root = ET.parse(write_dashboard(recs, tmp_path / "d.svg", entropy=4.0, title="t")).getroot()
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert texts.count("t") == 1  # the run's title on the loss panel
    assert {"MoE layer 0: load / mean", "MoE layer 1: load / mean", "expert placement", "after placement",
            "unigram entropy 4.00", "validation"} <= set(texts)


def test_a_run_without_matplotlib_ends_with_its_dashboard(tmp_path):
    # matplotlib is not a core dependency: a run must finish (summary, dashboard) without it
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from moebal.cli import main\n"
            f"sys.exit(main(['train', '--nproc', '1', '--steps', '2', '--out', {str(tmp_path / 'run')!r}, "
            "'model.dim=32', 'model.n_layers=1', 'model.n_heads=2', 'model.n_kv_heads=1', 'model.ffn_dim=64', "
            "'moe.num_experts=2', 'moe.expert_ffn_dim=32', 'data.seq_len=16', 'data.batch_size=2', "
            "'data.max_bytes=100000', 'train.eval_every=0', 'train.progress=plain']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "run" / "dashboard.svg").is_file() and (tmp_path / "run" / "summary.json").is_file()
