"""Writing a small text file whole or not at all: a reader (or a run stopped mid-write) never sees half of it."""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_text_whole"]


def write_text_whole(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file beside it, renamed over `path` (atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path
