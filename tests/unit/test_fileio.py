"""moebal/fileio.py: whole-file writes, the paths a command may replace, and a live log's whole lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moebal.errors import ConfigError
from moebal.fileio import complete_lines, refuse_replacing, write_text_whole


def test_a_directory_is_not_replaced_when_it_is_or_holds_what_must_be_kept(tmp_path: Path) -> None:
    src = tmp_path / "runs" / "a" / "ckpt-0000004"
    src.mkdir(parents=True)
    for dst, said in ((src, "is SRC"), (tmp_path / "runs" / "a", "contains SRC"), (tmp_path, "contains SRC")):
        with pytest.raises(ConfigError, match=f"DST {dst} {said}"):
            refuse_replacing(dst, "DST", {"SRC": src, "nothing": None})
    refuse_replacing(tmp_path / "runs" / "b", "DST", {"SRC": src})  # beside it: fine
    refuse_replacing(src / "hf", "DST", {"SRC": src})  # inside it: the source stays whole
    with pytest.raises(ConfigError, match="contains SRC"):  # a relative path resolves like the absolute one
        refuse_replacing(Path("."), "DST", {"SRC": Path.cwd() / "x"})


def test_a_whole_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    f = tmp_path / "config.yaml"
    write_text_whole(f, "a: 1\n")
    write_text_whole(f, "a: 2\n")
    assert f.read_text(encoding="utf-8") == "a: 2\n" and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_a_torn_last_line_is_left_out_and_a_bad_one_elsewhere_is_kept() -> None:
    assert complete_lines('{"a": 1}\n{"b": 2}\n') == ['{"a": 1}', '{"b": 2}']
    assert complete_lines('{"a": 1}\n{"b": ') == ['{"a": 1}']  # cut short while written
    assert complete_lines('{"a": 1}\n{"b": 2}') == ['{"a": 1}', '{"b": 2}']  # whole, its newline not yet there
    assert complete_lines('{"a": \n{"b": 2}\n') == ['{"a": ', '{"b": 2}']  # the reader rejects this one
    assert complete_lines("") == []


def test_the_readers_of_a_live_run_s_logs_skip_its_torn_last_line(tmp_path: Path, capsys) -> None:
    """plans.jsonl read by `moebal plan experts --counts` and `moebal simulate --routing`, and a rollback record
    cut off before its newline (a crash while appending: no record, its batches are retrained)."""
    from moebal.cli import main
    from moebal.sim.routing import read_routing_log
    from moebal.train.spikes import ROLLBACKS, read_rollbacks

    whole = json.dumps({"step": 1, "counts": [[[3, 1], [2, 2]]]})
    plans = tmp_path / "plans.jsonl"
    plans.write_text(whole + "\n" + whole[: len(whole) // 2])
    assert [a.shape for a in read_routing_log(plans)] == [(1, 2, 2)]
    assert main(["plan", "experts", "--counts", str(plans), "--policy", "static", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"][0]["num_ranks"] == 2
    record = {"step": 4, "reason": "loss spike", "resume_step": 2, "skip_extra": 1, "data": {}}
    (tmp_path / ROLLBACKS).write_text(json.dumps(record) + "\n" + json.dumps(record)[:40])
    assert [r["step"] for r in read_rollbacks(tmp_path)] == [4]


def test_a_calibrated_profile_is_written_whole(tmp_path: Path, monkeypatch) -> None:
    """A calibration killed while writing keeps the old profile (here the rename fails: nothing replaced)."""
    from moebal.planner.hardware import dump_profile, load_profile

    path = tmp_path / "local.yaml"
    dump_profile(load_profile("a100"), path)
    before = path.read_text()
    monkeypatch.setattr(Path, "replace", lambda self, target: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError, match="killed"):
        dump_profile(load_profile("h100"), path)
    assert path.read_text() == before
