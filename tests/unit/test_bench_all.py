"""scripts/bench_all.py: one command per README Results row, one JSON and one table, failures recorded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.cli_util import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench_all():
    return load_script("bench_all")


def _strip_json(cmd: str) -> str:
    return re.sub(r"\s--json(\s+\S+)?", "", cmd).strip()


def _readme_cells() -> list[list[str]]:
    """The cells of every row of the README's Results table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8").split("## Results", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| claim")]


def _readme_rows() -> list[tuple[str, str]]:
    """(claim, command) of every row of the README's Results table ("same command" resolved)."""
    rows, last = [], ""
    for cells in _readme_cells():
        cmd = cells[-1].strip("`") if cells[-1] != "same command" else last
        rows.append((cells[0], cmd))
        last = cmd
    return rows


def test_dry_run_lists_one_command_per_readme_row(bench_all, capsys) -> None:
    assert bench_all.main(["--full", "--dry-run"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    readme = _readme_rows()
    assert len(readme) == 40
    assert len(lines) == len(readme)
    for (claim, cmd), line in zip(readme, lines):
        shown = _strip_json(line.split("    # ")[0].split(None, 1)[1])
        assert shown == _strip_json(cmd), claim


def test_every_row_says_what_was_fitted_and_the_readme_says_the_same(bench_all) -> None:
    cells = _readme_cells()
    assert all(len(c) == 5 for c in cells), "claim | figure | fitted / predicted | machine | command"
    for row, readme in zip(bench_all.ROWS, cells, strict=True):
        assert row.basis and "fitted" in row.basis, row.claim
        assert readme[2] == row.basis, row.claim


def test_quick_uses_the_scripts_own_quick_option(bench_all, capsys) -> None:
    assert bench_all.main(["--quick", "--dry-run", "--only", "expert_parallel,reproduce_lina"]) == 0
    out = capsys.readouterr().out
    assert "scripts/bench_expert_parallel.py --quick --json FILE" in out
    assert "scripts/reproduce_lina.py --json FILE" in out  # no quick form: the default command
    assert "pipeline" not in out


def test_only_rejects_an_unknown_name(bench_all) -> None:
    with pytest.raises(SystemExit):
        bench_all.main(["--quick", "--only", "nope"])


def test_a_run_writes_the_json_and_the_table_and_records_failures(bench_all, tmp_path) -> None:
    good = tmp_path / "good.py"
    good.write_text("import json, sys\n"
                    "path = sys.argv[sys.argv.index('--json') + 1]\n"
                    "quick = '--quick' in sys.argv\n"
                    "json.dump({'rounds': [1.2, 1.5, 1.3], 'quick': quick}, open(path, 'w'))\n")
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.exit('bad.py: the fake benchmark broke')\n")
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(30)\n")
    Run, Row = bench_all.Run, bench_all.Row
    runs = (Run("good", ("python", str(good)), ("python", str(good), "--quick")),
            Run("bad", ("python", str(bad))),
            Run("slow", ("python", str(slow)), timeout_s=1.0),
            Run("gpu", ("python", str(good)), gpu=True),
            Run("other", ("python", str(good))))
    rows = (Row("good claim", "good", lambda d: bench_all._spread(d["rounds"]) + f" quick={d['quick']}",
                "measured; nothing fitted"),
            Row("good claim, missing key", "good", lambda d: d["absent"]),
            Row("bad claim", "bad", lambda d: "never"),
            Row("slow claim", "slow", lambda d: "never"),
            Row("gpu claim", "gpu", lambda d: "never"),
            Row("not selected", "other", lambda d: "never"))
    out_json, out_md = tmp_path / "all.json", tmp_path / "all.md"
    rc = bench_all.main(["--quick", "--only", "good,bad,slow,gpu", "--json", str(out_json), "--table", str(out_md)],
                        runs=runs, rows=rows, cuda=False)
    assert rc == 1  # a run failed; the others still ran
    report = json.loads(out_json.read_text())
    recs = report["runs"]
    assert set(recs) == {"good", "bad", "slow", "gpu"}
    assert recs["good"]["status"] == "ok" and recs["good"]["exit_status"] == 0
    assert recs["good"]["result"] == {"rounds": [1.2, 1.5, 1.3], "quick": True}
    assert recs["good"]["command"].endswith("good.py --quick --json FILE")
    assert recs["bad"]["status"] == "failed" and "the fake benchmark broke" in recs["bad"]["message"]
    assert recs["slow"]["status"] == "failed" and "timed out" in recs["slow"]["message"]
    assert recs["gpu"]["status"] == "skipped" and "CUDA" in recs["gpu"]["message"]
    figures = {r["claim"]: r["figure"] for r in report["rows"]}
    assert figures["good claim"] == "median 1.300x (min 1.200x, max 1.500x, 3 rounds) quick=True"
    assert figures["good claim, missing key"] == "n/a (the JSON lacks 'absent')"
    assert figures["bad claim"].startswith("n/a (exit status 1")
    assert figures["slow claim"].startswith("n/a (timed out")
    assert figures["gpu claim"].startswith("skipped (needs a CUDA device")
    assert "not selected" not in figures
    table = out_md.read_text().splitlines()
    assert table[0] == "| claim | figure | fitted / predicted | machine | command |"
    assert len(table) == 2 + 5
    assert "median 1.300x" in table[2] and report["machine"]["torch"] in table[2]
    assert "| measured; nothing fitted |" in table[2]
    assert {r["claim"]: r["basis"] for r in report["rows"]}["good claim"] == "measured; nothing fitted"


def test_a_stopped_run_keeps_what_finished_and_resume_runs_only_the_rest(bench_all, tmp_path) -> None:
    counter = tmp_path / "calls.txt"
    good = tmp_path / "good.py"
    good.write_text("import json, sys\n"
                    f"open({str(counter)!r}, 'a').write(sys.argv[1] + '\\n')\n"
                    "json.dump({'v': 1}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n")
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.exit('bad.py: broke')\n")
    Run, Row = bench_all.Run, bench_all.Row
    runs = (Run("a", ("python", str(good), "a")), Run("b", ("python", str(bad))), Run("c", ("python", str(good), "c")))
    rows = tuple(Row(f"{r.name} claim", r.name, lambda d: str(d["v"]), "measured; nothing fitted") for r in runs)
    out = tmp_path / "all.json"
    assert bench_all.main(["--full", "--json", str(out)], runs=runs, rows=rows, cuda=False) == 1
    first = json.loads(out.read_text())
    assert first["complete"] is True and first["mode"] == "full"
    for name in ("a", "c"):
        rec = first["runs"][name]
        assert rec["status"] == "ok" and rec["started"] and "load_start" in rec and "load_end" in rec
        assert rec["commit"] is None or len(rec["commit"].split("+")[0]) == 40
    # a report written part-way (as after the first run) says so
    partial = {**first, "complete": False, "runs": {"a": first["runs"]["a"]}}
    out.write_text(json.dumps(partial))
    counter.write_text("")
    bad.write_text("import json, sys\njson.dump({'v': 2}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n")
    assert bench_all.main(["--full", "--json", str(out), "--resume", str(out)], runs=runs, rows=rows, cuda=False) == 0
    assert counter.read_text().split() == ["c"]  # "a" kept, "b" (fixed) and "c" run; "b" writes no counter line
    second = json.loads(out.read_text())
    assert second["complete"] is True
    assert second["runs"]["a"]["resumed_from"] == str(out)
    assert {r["claim"]: r["figure"] for r in second["rows"]} == {"a claim": "1", "b claim": "2", "c claim": "1"}
    # --only with --resume adds the chosen runs to the report and keeps the others it held, in every report it
    # writes: the one written after "a" already holds the kept "b" (a run stopped in "c" keeps it)
    partial = {**second, "runs": {"b": second["runs"]["b"]}}
    out.write_text(json.dumps(partial))
    counter.write_text("")
    good.write_text("import json, shutil, sys\n"
                    f"if sys.argv[1] == 'c': shutil.copy({str(out)!r}, {str(tmp_path / 'during_c.json')!r})\n"
                    f"open({str(counter)!r}, 'a').write(sys.argv[1] + '\\n')\n"
                    "json.dump({'v': 1}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n")
    assert bench_all.main(["--full", "--only", "a,c", "--json", str(out), "--resume", str(out)], runs=runs,
                          rows=rows, cuda=False) == 0
    assert counter.read_text().split() == ["a", "c"]
    assert set(json.loads((tmp_path / "during_c.json").read_text())["runs"]) == {"a", "b"}
    assert set(json.loads(out.read_text())["runs"]) == {"a", "b", "c"}
    assert json.loads(out.read_text())["complete"] is True
    assert bench_all.main(["--full", "--only", "a", "--json", str(tmp_path / "a.json")], runs=runs, rows=rows,
                          cuda=False) == 0
    only_a = json.loads((tmp_path / "a.json").read_text())
    assert only_a["complete"] is False and only_a["missing"] == ["b", "c"]  # complete: every run of the registry
    with pytest.raises(SystemExit, match="--full run"):
        bench_all.main(["--quick", "--resume", str(out)], runs=runs, rows=rows, cuda=False)
    out.write_text(json.dumps({**second, "machine": {**second["machine"], "cpus": "512"}}))
    with pytest.raises(SystemExit, match="another machine"):
        bench_all.main(["--full", "--resume", str(out)], runs=runs, rows=rows, cuda=False)
    (tmp_path / "junk.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a bench_all JSON"):
        bench_all.main(["--full", "--resume", str(tmp_path / "junk.json")], runs=runs, rows=rows, cuda=False)


def test_render_fills_the_rows_of_successful_runs_from_several_reports_into_the_readme(bench_all, tmp_path) -> None:
    Run, Row = bench_all.Run, bench_all.Row
    runs = (Run("a", ("python", "a.py")), Run("b", ("python", "b.py")), Run("t", ("python", "-m", "pytest", "x")),
            Run("c", ("python", "c.py")))
    rows = (Row("a claim", "a", lambda d: f"{d['v']:.2f}x", "measured; nothing fitted", target="1.5x"),
            Row("b claim", "b", lambda d: f"{d['v']}", "measured; nothing fitted"),
            Row("t claim", "t", bench_all.fig_pytest, "a test's assertion; nothing fitted", asserts="it holds"),
            Row("c claim", "c", lambda d: "never", "measured; nothing fitted"))
    bf16 = {"cpu": "AMD EPYC", "cpus": "2", "torch": "2.13.0+cpu", "cuda_device": "", "isa": "avx512_bf16 avx2"}
    xeon = {"cpu": "Intel(R) Xeon(R) Processor", "cpus": "2", "torch": "2.13.0+cpu", "cuda_device": ""}

    def rec(name: str, result: object, status: str = "ok") -> dict[str, object]:
        return {"name": name, "command": f"python {name}.py", "status": status, "result": result}

    old = tmp_path / "old.json"
    old.write_text(json.dumps({"machine": xeon, "runs": {"a": rec("a", {"v": 1.0}), "b": rec("b", {"v": 7})}}))
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"machine": bf16, "runs": {
        "a": rec("a", {"v": 1.25}), "t": rec("t", {"pytest_summary": "3 passed in 1.0s"}),
        "c": {**rec("c", None, "failed"), "message": "broke"}}}))
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Results\n\nIntro.\n\n| claim | figure | fitted / predicted | machine | command |\n"
                      "|---|---|---|---|---|\n"
                      + "".join(f"| {r.claim} | old | {r.basis} | old-machine | `cmd` |\n" for r in rows)
                      + "\n## Next\n\nkept\n")
    table = tmp_path / "t.md"
    assert bench_all.main(["--render", str(old), str(new), "--readme", "--table", str(table)], runs=runs,
                          rows=rows, readme=readme) == 0
    text = readme.read_text()
    assert "| a claim | 1.25x (target 1.5x) | measured; nothing fitted | CPU-bf16 | `cmd` |" in text  # later wins
    assert "| b claim | 7 | measured; nothing fitted | CPU-Xeon | `cmd` |" in text
    assert "| t claim | it holds: 3 passed in 1.0s | a test's assertion; nothing fitted | test | `cmd` |" in text
    assert "| c claim | old | measured; nothing fitted | old-machine | `cmd` |" in text  # failed: kept as it was
    assert text.startswith("# x\n\n## Results\n\nIntro.") and text.endswith("\n## Next\n\nkept\n")
    assert len(table.read_text().splitlines()) == 2 + 3
    # a README whose table does not match the registry is refused, nothing written
    readme.write_text("## Results\n\n| claim | figure | fitted / predicted | machine | command |\n"
                      "|---|---|---|---|---|\n| only one | x | y | z | `w` |\n")
    with pytest.raises(SystemExit, match="1 rows, the registry 4"):
        bench_all.main(["--render", str(new), "--readme"], runs=runs, rows=rows, readme=readme)
    assert "only one" in readme.read_text()
    with pytest.raises(SystemExit):
        bench_all.main(["--full", "--readme"], runs=runs, rows=rows, readme=readme)


def test_machine_labels(bench_all) -> None:
    label = bench_all.machine_label
    assert label({"cpu": "AMD EPYC", "isa": "avx512_bf16 avx512f avx2", "cuda_device": ""}) == "CPU-bf16"
    assert label({"cpu": "AMD EPYC", "isa": "avx2", "cuda_device": ""}) == "CPU-AVX2"
    assert label({"cpu": "Intel(R) Xeon(R) Platinum", "isa": "amx_bf16 avx512_bf16 avx512f avx2",
                  "cuda_device": ""}) == "CPU-AMX"
    assert label({"cpu": "Intel(R) Xeon(R) Processor", "cuda_device": ""}) == "CPU-Xeon"  # reports before `isa`
    assert label({"cpu": "x", "isa": "", "cuda_device": "NVIDIA H200"}) == "H200"


def test_lina_inference_figure_names_every_width_device_and_rank_count(bench_all) -> None:
    def summ(lina: float, equal: bool = True) -> dict:
        return {"static_over_lina": lina, "static_over_oracle": lina + 0.05,
                "static_over_lina_experts_layers_1_on": 1.7,
                **{p: {"equal_static": equal} for p in ("lina", "phase1", "oracle")}}

    data = {"settings": {"rounds": 10}, "by_width": {
        "4096": {"by_ranks": {"4": summ(1.09)}, "by_ranks_dilated": {"3": {"4": summ(1.41)}}},
        "1024": {"by_ranks": {"4": summ(1.0)}, "by_ranks_dilated": {"3": {"4": summ(1.12)}}}}}
    fig = bench_all.fig_lina_inference(data)
    assert re.findall(r"width [\d,]+, \d+ ranks, [^:]+", fig) == [
        "width 1,024, 4 ranks, CPU", "width 1,024, 4 ranks, emulated 3x",
        "width 4,096, 4 ranks, CPU", "width 4,096, 4 ranks, emulated 3x"]
    assert "emulated 3x: 1.41x (oracle 1.46x; experts 1.70x)" in fig and "over 10 rounds" in fig
    assert fig.endswith("equal static's: True")
    data["by_width"]["1024"]["by_ranks"]["4"] = summ(1.0, equal=False)
    assert bench_all.fig_lina_inference(data).endswith("equal static's: False")
    with pytest.raises(ValueError, match="by_width"):
        bench_all.fig_lina_inference({"by_ranks": {}})


def test_pipeline_figure_lists_every_balancer_not_the_best_one(bench_all) -> None:
    summary = {"speedup_per_round": {"dilate/mod/partition": [1.05, 1.1, 1.2], "dilate/mod/diffusion": [1.3],
                                     "dilate/freezing/partition": [1.4]},
               "targets": {"rebalancing overhead <= 5%": {"measured": 0.01, "median": 0.005}},
               "identical_losses_across_variants": {"g0": True}}
    fig = bench_all.fig_pipeline("mod")({"summary": summary})
    assert fig.startswith("dilate/mod/partition: median 1.100x (min 1.050x, max 1.200x, 3 rounds); "
                          "dilate/mod/diffusion: 1.300x (1 round) static throughput")
    assert "freezing" not in fig
