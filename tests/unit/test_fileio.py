"""moebal/fileio.py: whole-file writes and the paths a command may replace."""

from __future__ import annotations

from pathlib import Path

import pytest

from moebal.errors import ConfigError
from moebal.fileio import refuse_replacing, write_text_whole


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
