"""Writing a small text file whole or not at all: a reader (or a run stopped mid-write) never sees half of it."""

from __future__ import annotations

from pathlib import Path

from moebal.errors import ConfigError

__all__ = ["make_folder_of", "output_path", "write_text_whole"]


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


def write_text_whole(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file beside it, renamed over `path` (atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path
