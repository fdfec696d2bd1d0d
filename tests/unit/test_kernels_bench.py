"""`moebal bench layer` end to end on a tiny shape: JSON records and PNG are written and self-consistent."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from moebal.cli import main


def test_bench_layer_writes_json_and_png(tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "layer", "--tokens", "32", "--dim", "16", "--ffn", "16", "--experts", "4", "--repeats", "1",
               "--warmup", "0", "--threads", "1", "--json", str(out), "--png", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["env"]["torch"] and data["shape"]["tokens"] == 32
    timed = [r for r in data["records"] if "skipped" not in r]
    groups = {(r["dtype"], r["routing"]) for r in timed}
    assert groups == {("fp32", "balanced"), ("fp32", "skewed"), ("bf16", "balanced"), ("bf16", "skewed")}
    for r in timed:
        assert r["median_s"] > 0 and r["threads"] == 1 and r["top_k"] == 2
        if r["method"] == "dense":
            assert r["ratio_to_dense"] == 1.0
    assert {r["method"] for r in timed} >= {"dense", "moebal", "loop"}
    skew = [r for r in timed if r["method"] == "moebal" and r["routing"] == "skewed"]
    assert all(r["imbalance"] > 1.5 for r in skew)  # the skew really skews
    assert png.stat().st_size > 0


def test_bench_layer_rejects_bad_lists(capsys) -> None:
    assert main(["bench", "layer", "--dtypes", "fp16"]) == 2
    assert "fp32, bf16" in capsys.readouterr().err
    # a size of 0 is refused, not taken as "the default" (it once ran the default shape)
    assert main(["bench", "layer", "--quick", "--experts", "0"]) == 2
    assert "experts=0" in capsys.readouterr().err
    assert main(["bench", "layer", "--device", "tpu"]) == 2
    assert "expected cuda, cuda:N or cpu" in capsys.readouterr().err
    assert main(["bench", "layer", "--quick", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert main(["bench", "layer", "--quick", "--warmup", "-1"]) == 2  # it once ran without a warm-up
    assert "--warmup must be >= 0" in capsys.readouterr().err


def test_bench_layer_names_an_output_it_cannot_write_before_it_times(capsys, tmp_path, monkeypatch) -> None:
    import moebal.commands.bench as bench

    def never(*a, **k):
        raise AssertionError("timed before its outputs were checked")

    monkeypatch.setattr(bench, "_bench_case", never)
    (tmp_path / "a-file").write_text("")
    for flag in ("--json", "--png"):
        assert main(["bench", "layer", "--quick", flag, str(tmp_path / "a-file" / "out")]) == 2
        assert f"{flag} {tmp_path / 'a-file' / 'out'}: cannot make its folder" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: importing it raises ImportError
    assert main(["bench", "layer", "--quick", "--png", str(tmp_path / "b.png")]) == 2
    assert "--png draws with matplotlib, which is not installed" in capsys.readouterr().err


def test_a_count_option_below_its_least_is_named_by_argparse(capsys) -> None:
    from moebal.commands.bench import at_least

    ap = argparse.ArgumentParser(prog="bench_x")
    ap.add_argument("--rounds", type=at_least(1), default=3)
    ap.add_argument("--load", type=at_least(0), default=0)
    assert ap.parse_args(["--rounds", "2", "--load", "0"]).rounds == 2
    for argv, said in ((["--rounds", "0"], "argument --rounds: must be >= 1; got 0"),
                       (["--load", "-1"], "argument --load: must be >= 0; got -1"),
                       (["--rounds", "x"], "argument --rounds: invalid int value: 'x'")):
        with pytest.raises(SystemExit) as exit_:
            ap.parse_args(argv)
        assert exit_.value.code == 2 and said in capsys.readouterr().err
