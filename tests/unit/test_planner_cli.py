"""`moebal plan experts`: count files in every accepted format, JSON and table output, --bench, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moebal.cli import main

M1 = [[40, 5, 5, 10], [30, 10, 10, 10], [30, 10, 10, 10], [20, 15, 15, 10]]
UNIT = {"token_bytes": 1, "expert_param_bytes": 50, "expert_grad_bytes": 50, "expert_tokens_per_s": 1,
        "a2a_bandwidth": 1, "trans_bandwidth": 1, "agg_bandwidth": 1}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(M1))
    (tmp_path / "unit.json").write_text(json.dumps(UNIT))
    return tmp_path


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_json_output_every_policy(files, capsys):
    out = _json(capsys, ["plan", "experts", "--counts", str(files / "c.json"), "--costs", str(files / "unit.json"),
                         "--alpha", "1", "--json"])
    (layer,) = out["layers"]
    plans = {p["policy"]: p for p in layer["plans"]}
    assert set(plans) == {"prophet", "fastermoe", "static", "broadcast_topk"}
    assert plans["prophet"]["placement"]["replicas"] == [[1, 2, 3], [], [], []]
    assert plans["prophet"]["placement"]["predicted_time"] == 430
    assert plans["static"]["metrics"]["predicted_time_s"] == 680
    assert plans["prophet"]["metrics"]["rb"] == pytest.approx(2.828, abs=1e-3)


def test_table_output_and_options(files, capsys):
    assert main(["plan", "experts", "--counts", str(files / "c.json"), "--costs", str(files / "unit.json"),
                 "--policy", "prophet", "--n", "0,1", "--alpha", "1"]) == 0
    out = capsys.readouterr().out
    assert "405 s" in out and "E0 (owner 0) -> 1,2" in out and "fastermoe" not in out


def test_npy_three_d_and_jsonl(files, capsys):
    np.save(files / "c.npy", np.array([M1, np.ones((4, 4)).tolist()]))
    out = _json(capsys, ["plan", "experts", "--counts", str(files / "c.npy"), "--policy", "static", "--json"])
    assert [layer["layer"] for layer in out["layers"]] == [0, 1]
    out = _json(capsys, ["plan", "experts", "--counts", str(files / "c.npy"), "--layer", "1", "--json",
                         "--policy", "static"])
    assert out["layers"][0]["tokens"] == 16
    log = files / "plans.jsonl"
    log.write_text(json.dumps({"step": 0, "counts_RE": np.ones((4, 4)).tolist()}) + "\n"
                   + json.dumps({"step": 1, "layers": [{"counts_RE": M1}]}) + "\n")
    out = _json(capsys, ["plan", "experts", "--counts", str(log), "--policy", "static", "--json"])
    assert out["layers"][0]["tokens"] == 240  # the last record by default
    out = _json(capsys, ["plan", "experts", "--counts", str(log), "--line", "0", "--policy", "static", "--json"])
    assert out["layers"][0]["tokens"] == 16


def test_bench_flag_reports_latency(capsys):
    out = _json(capsys, ["plan", "experts", "--bench", "--bench-sizes", "8x16", "--repeats", "3", "--json",
                         "--policy", "prophet"])
    (rec,) = out["records"]
    assert (rec["ranks"], rec["experts"], rec["repeats"]) == (8, 16, 3)
    assert 0 < rec["min_ms"] <= rec["median_ms"] <= rec["max_ms"]
    assert out["env"]["numpy"] == np.__version__


@pytest.mark.parametrize("content, match", [
    ("[[1, 2, 3], [4, 5, 6]]", "3 experts cannot be sharded evenly over 2 ranks"),
    ("[[1, -2], [3, 4]]", "must be >= 0"),
    ("[1, 2, 3]", "R x E or L x R x E"),
    ("[[1, 2], [3]]", "rectangular"),
    ("{not json", "cannot parse"),
    ('{"foo": 1}', "'counts_RE', 'counts' or 'layers'"),
    ('{"step": 5, "expert_counts": [[3, 1]]}', "give the run's plans.jsonl"),  # a metrics.jsonl record
])
def test_bad_input_is_one_clear_line(tmp_path, capsys, content, match):
    f = tmp_path / "bad.json"
    f.write_text(content)
    assert main(["plan", "experts", "--counts", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moebal plan: error: ") and "Traceback" not in err
    assert match in err


def test_other_errors(tmp_path, capsys, files):
    assert main(["plan", "experts", "--counts", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["plan", "experts"]) == 2
    assert "needs --counts" in capsys.readouterr().err
    assert main(["plan", "experts", "--counts", str(files / "c.json"), "--owner", "0,x"]) == 2
    assert "--owner" in capsys.readouterr().err
    assert main(["plan", "experts", "--counts", str(files / "c.json"), "--owner", "0,1"]) == 2
    assert "owner map" in capsys.readouterr().err
    (tmp_path / "costs.json").write_text('{"tokn_bytes": 1}')
    assert main(["plan", "experts", "--counts", str(files / "c.json"), "--costs", str(tmp_path / "costs.json")]) == 2
    assert "tokn_bytes" in capsys.readouterr().err
    assert main(["plan"]) == 2
    assert "experts" in capsys.readouterr().err  # the target list
    for flag in ("--repeats", "--k"):  # counts below 1 once ran "a median of 0" or a top-0 broadcast
        with pytest.raises(SystemExit):
            main(["plan", "experts", "--counts", str(files / "c.json"), flag, "0"])
        assert f"argument {flag}: must be >= 1; got 0" in capsys.readouterr().err
