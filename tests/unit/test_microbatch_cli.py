"""`moebal plan microbatches`: every method side by side, JSON output, length files, and clear errors."""

from __future__ import annotations

import json

import numpy as np

from moebal.cli import main
from moebal.planner.microbatch import MicroBatchPlan


def _lengths(tmp_path, n: int = 120, max_len: int = 2048):
    rng = np.random.default_rng(0)
    L = np.clip(rng.lognormal(np.log(150), 1.1, n), 1, max_len).astype(int)
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(L.tolist()))
    return path, L


def test_plan_microbatches_json(capsys, tmp_path):
    path, L = _lengths(tmp_path)
    assert main(["plan", "microbatches", "--lengths", str(path), "--stages", "4", "--max-len", "2048",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plans = out["plans"]
    assert set(plans) == {"dynamic", "padding", "packing", "tokens"} and out["samples"] == len(L)
    assert all(p["deadlock_free"] for p in plans.values())
    assert plans["dynamic"]["padding_efficiency"] >= 0.9 > 0.5 > plans["padding"]["padding_efficiency"]
    assert plans["dynamic"]["predicted_time_s"] < plans["packing"]["predicted_time_s"]
    mbs = plans["dynamic"]["plan"]["micro_batches"]
    assert sorted(i for m in mbs for r in m["rows"] for i in r) == list(range(len(L)))
    assert main(["plan", "microbatches", "--lengths", str(path), "--stages", "4", "--max-len", "2048",
                 "--dp", "2", "--memory", "2e10", "--method", "dynamic"]) == 0
    text = capsys.readouterr().out
    assert "replica 1" in text and "dynamic" in text


def test_plan_microbatches_length_files_and_errors(capsys, tmp_path):
    lines = tmp_path / "samples.jsonl"
    lines.write_text('{"text": "hello world"}\n{"length": 40}\n\n{"text": "h\\u00e9"}\n')
    assert main(["plan", "microbatches", "--lengths", str(lines), "--stages", "2", "--max-len", "512",
                 "--method", "dynamic", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 11 + 40 + 3  # UTF-8 bytes: the byte tokenizer
    txt = tmp_path / "lengths.txt"
    txt.write_text("12\n0\n7\n")
    assert main(["plan", "microbatches", "--lengths", str(txt), "--stages", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("sample 1 has length 0") == 1, err  # every method's reason is the same: said once
    assert main(["plan", "microbatches", "--lengths", str(txt), "--stages", "2", "--max-len", "0"]) == 2
    assert "--max-len must be >= 1" in capsys.readouterr().err
    txt.write_text("12\n9000\n")
    assert main(["plan", "microbatches", "--lengths", str(txt), "--stages", "2"]) == 2
    assert "longer than the model's maximum 8192" in capsys.readouterr().err
    txt.write_text("12\nabc\n")
    assert main(["plan", "microbatches", "--lengths", str(txt), "--stages", "2"]) == 2
    assert "lengths.txt:2" in capsys.readouterr().err
    assert main(["plan", "microbatches", "--stages", "2"]) == 2
    assert "--lengths" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "x"}\n')
    assert main(["plan", "microbatches", "--lengths", str(bad), "--stages", "2"]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_plan_microbatches_in_lockstep(capsys, tmp_path):
    """`--lockstep N`: the plan a stage of N ranks runs together (Lockstep.of in moebal/pipeline/planned.py):
    every micro-batch has a row for each rank, the ranks' parts cover its rows, the text shows each rank's rows."""
    path, L = _lengths(tmp_path, n=60)
    assert main(["plan", "microbatches", "--lengths", str(path), "--stages", "2", "--max-len", "2048",
                 "--method", "dynamic", "--lockstep", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lockstep"] == 3
    plan = MicroBatchPlan.from_dict(out["plans"]["dynamic"]["plan"])
    assert plan.lockstep == 3 and out["plans"]["dynamic"]["deadlock_free"]
    for mb in plan.micro_batches:
        parts = [mb.part(k, 3) for k in range(3)]
        assert all(parts) and sorted(r for p in parts for r in p) == sorted(mb.rows)
    assert sorted(i for m in plan.micro_batches for r in m.rows for i in r) == list(range(len(L)))
    # the same batch planned for one rank: the lockstep plan is costed at its busiest rank's third of each
    # micro-batch, so it predicts a shorter step
    assert main(["plan", "microbatches", "--lengths", str(path), "--stages", "2", "--max-len", "2048",
                 "--method", "dynamic", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)["plans"]["dynamic"]
    assert out["plans"]["dynamic"]["predicted_time_s"] < alone["predicted_time_s"]
    assert main(["plan", "microbatches", "--lengths", str(path), "--stages", "2", "--max-len", "2048",
                 "--method", "dynamic", "--lockstep", "3"]) == 0
    text = capsys.readouterr().out
    assert "x 3 ranks in lockstep" in text and "rows per lockstep rank (r0/r1/r2)" in text
    assert main(["plan", "microbatches", "--lengths", str(path), "--stages", "2", "--lockstep", "0"]) == 2
    assert "--lockstep 0" in capsys.readouterr().err


def test_a_method_that_cannot_plan_the_input_is_reported_beside_the_others(capsys, tmp_path):
    """10 short samples pack into one row, which cannot give 2 lockstep ranks a row each: packing is infeasible,
    and `--method all` reports it with the reason and still plans the others; alone, it is the error."""
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([12, 300, 45, 800, 33, 120, 7, 512, 64, 200]))
    args = ["plan", "microbatches", "--lengths", str(path), "--stages", "4", "--lockstep", "2"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["plans"]) == {"dynamic", "padding", "tokens"}
    assert "1 rows cannot give each of the 2 ranks" in out["infeasible"]["packing"]
    assert main(args) == 0
    assert "packing  infeasible: no micro-batch count" in capsys.readouterr().out
    assert main([*args, "--method", "packing"]) == 2
    err = capsys.readouterr().err
    assert "no micro-batch count of the baseline fits" in err and "1 micro-batches: a micro-batch of 1 rows" in err


def test_plan_microbatches_profile_then_plan(capsys, tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("model: {dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, max_seq_len: 64}\n"
                   "moe: {num_experts: 0}\ndata: {seq_len: 64}\ntrain: {precision: fp32}\n")
    table = tmp_path / "cost.json"
    assert main(["plan", "microbatches", "--profile", str(table), "--config", str(cfg), "--stages", "2",
                 "--max-tokens", "256"]) == 0
    assert "wrote" in capsys.readouterr().out
    data = json.loads(table.read_text())
    assert data["s_grid"] == [16, 32, 64] and data["b_grid"][-1] == 16 and data["fwd_s"][0][0][0] > 0
    assert data["fwd_s"][0][-1][-1] is None  # 16 x 64 tokens is beyond the cap: not profiled
    lengths = tmp_path / "l.json"
    lengths.write_text(json.dumps([60, 5, 9, 33, 17, 64, 2, 40]))
    assert main(["plan", "microbatches", "--lengths", str(lengths), "--stages", "2", "--cost", str(table)]) == 0
    assert "measured" in capsys.readouterr().out
    assert main(["plan", "microbatches", "--lengths", str(lengths), "--stages", "3", "--cost", str(table)]) == 2
    assert "has 2 stages" in capsys.readouterr().err
    lengths.write_text(json.dumps([65]))
    assert main(["plan", "microbatches", "--lengths", str(lengths), "--stages", "2", "--cost", str(table)]) == 2
    assert "longer than the model's maximum 64" in capsys.readouterr().err
