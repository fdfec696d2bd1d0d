"""Writing a small text file whole or not at all: a reader (or a run stopped mid-write) never sees half of it;
the paths a command writes checked before it writes; reading a user's text or JSON file with a one-line error
(never a traceback) when it is missing, unreadable, not UTF-8 or not JSON; a file's SHA-256."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moebal.errors import ConfigError, MoebalError

__all__ = ["complete_lines", "make_folder_of", "output_path", "read_json", "read_text", "refuse_replacing",
           "sha256_of", "write_text_whole"]


def read_text(path: str | Path, what: str, error: type[MoebalError] = ConfigError) -> str:
    """The UTF-8 text of the file `path`; an `error` "{what} {path}: cannot read it (...)" when it is missing,
    unreadable or not UTF-8 text (a binary file given by mistake)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise error(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise error(f"{what} {path}: cannot read it (not UTF-8 text: {e.reason} at byte {e.start})") from None


def read_json(path: str | Path, what: str, error: type[MoebalError] = ConfigError) -> Any:
    """The parsed JSON file `path` (any JSON value: the caller checks its shape); an `error` naming `what` and
    the path when it cannot be read (`read_text`) or is not valid JSON."""
    text = read_text(path, what, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} {path}: not valid JSON ({e})") from None


def sha256_of(path: str | Path) -> str:
    """The hex SHA-256 of the file `path`, read in 4 MiB chunks (a checkpoint's shards do not fit in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


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
