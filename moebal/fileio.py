"""Writing a small text file whole or not at all: a reader (or a run stopped mid-write) never sees half of it;
the paths a command writes checked before it writes."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from moebal.errors import ConfigError

__all__ = ["complete_lines", "make_folder_of", "output_path", "refuse_replacing", "write_text_whole"]


def make_folder_of(path: str | Path, flag: str) -> Path:
    """`path` with its folder made if missing; a ConfigError naming the flag when the folder cannot be made (a
    file in the way, no permission). `path` itself may be a file or a directory still to be written."""
    path = Path(path)
    try:
        path.absolute().parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot make its folder ({e.strerror}): give a writable path") from None
    return path


def output_path(path: str | Path, flag: str) -> Path:
    """A command's output file, its folder made if missing (as `--json` and `moebal calibrate --out` do); a
    ConfigError naming the flag when the folder cannot be made (`make_folder_of`) or the path is a folder."""
    path = make_folder_of(path, flag)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: give a file path")
    return path


def refuse_replacing(dst: str | Path, flag: str, keep: Mapping[str, str | Path | None]) -> None:
    """A ConfigError when the directory `dst` (which a writer replaces whole) is, or contains, one of `keep`
    (name -> path; None skipped): replacing it would delete what must be kept, whatever --overwrite says."""
    target = Path(dst).resolve()
    for name, path in keep.items():
        if path is None:
            continue
        kept = Path(path).resolve()
        if kept == target or kept.is_relative_to(target):
            where = "is" if kept == target else "contains"
            raise ConfigError(f"{flag} {dst} {where} {name} ({path}): writing it replaces the whole directory, "
                              f"which would delete {name}; give a new directory")


def write_text_whole(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file beside it, flushed to disk and renamed over `path`
    (atomic on POSIX; a crash leaves the old file or the new one, never an empty one)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def complete_lines(text: str) -> list[str]:
    """The lines of a JSON-lines log its writer appends whole: a last line without its newline that does not
    parse is a write cut short (a crash, or a writer still at it) and is left out, as a reader of a live run's
    log must; a bad line anywhere else stays for the reader to reject."""
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except ValueError:
            lines.pop()
    return lines
