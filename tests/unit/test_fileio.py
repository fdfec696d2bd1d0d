"""moebal/fileio.py: whole-file writes, the paths a command may replace, a live log's whole lines, and reading a
user's text or JSON file with a one-line error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moebal.errors import ConfigError, DataError
from moebal.fileio import complete_lines, read_json, read_text, refuse_replacing, sha256_of, write_text_whole


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


BINARY = b"\x89PNG\r\n\x1a\n\x00\xff\xfe"  # a file given by mistake: not UTF-8 text


def test_a_missing_binary_or_broken_json_file_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "bin.json").write_bytes(BINARY)
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    (tmp_path / "ok.json").write_text('{"a": [1, 2]}', encoding="utf-8")
    assert read_json(tmp_path / "ok.json", "--x") == {"a": [1, 2]}
    for name, said in (("none.json", "cannot read it (No such file"), ("bin.json", "cannot read it (not UTF-8 text"),
                       ("bad.json", "not valid JSON (")):
        with pytest.raises(ConfigError, match=r"^--x \S+" + name.replace(".", r"\.") + ": " + re.escape(said)):
            read_json(tmp_path / name, "--x")
    with pytest.raises(DataError, match="log .*bin.json: cannot read it"):
        read_text(tmp_path / "bin.json", "log", DataError)


def test_sha256_of_a_file() -> None:
    import hashlib
    import tempfile

    with tempfile.NamedTemporaryFile() as f:
        f.write(b"x" * ((1 << 22) + 5))  # more than one chunk
        f.flush()
        assert sha256_of(f.name) == hashlib.sha256(b"x" * ((1 << 22) + 5)).hexdigest()


@pytest.mark.parametrize("argv, flag", [
    (["plan", "experts", "--counts", "{bin}.json"], "--counts"),
    (["plan", "experts", "--counts", "{bin}.jsonl"], "--counts"),
    (["plan", "experts", "--counts", "{counts}", "--costs", "{bin}.json"], "--costs"),
    (["plan", "microbatches", "--lengths", "{bin}.json", "--stages", "2"], "--lengths"),
    (["plan", "microbatches", "--lengths", "{lengths}", "--stages", "2", "--cost", "{bin}.json"], "cost table"),
    (["plan", "stages", "--costs", "{bin}.json", "--stages", "2"], "--costs"),
    (["simulate", "--routing", "{bin}.jsonl"], "routing log"),
    (["calibrate", "--quick", "--out", "{tmp}/p.yaml", "--from-records", "{bin}.json"], "--from-records"),
    (["convert", "hf-to-moebal", "{bin}", "{tmp}/mb"], "HF config"),  # {bin}/config.json
])
def test_a_binary_input_file_is_a_one_line_error_at_every_cli_site(tmp_path: Path, capsys, argv: list[str],
                                                                    flag: str) -> None:
    from moebal.cli import main

    for suffix in (".json", ".jsonl"):
        (tmp_path / f"bin{suffix}").write_bytes(BINARY)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_bytes(BINARY)
    (tmp_path / "counts.json").write_text("[[3, 1], [2, 2]]", encoding="utf-8")
    (tmp_path / "lengths.json").write_text("[100, 200, 300, 400]", encoding="utf-8")
    paths = {"bin": tmp_path / "bin", "counts": tmp_path / "counts.json", "lengths": tmp_path / "lengths.json",
             "tmp": tmp_path}
    assert main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f": error: {flag} {tmp_path / 'bin'}" in err and "cannot read it (not UTF-8 text" in err, err
