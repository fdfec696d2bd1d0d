"""Progress display: a one-line bar redrawn in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


class Progress:
    """`update` every step; the bar redraws at most ten times a second, plain mode prints every `every`
    steps and whenever a validation loss arrives."""

    def __init__(self, total: int, start: int = 0, mode: str = "auto", stream: TextIO | None = None,
                 width: int = 24) -> None:
        self.stream = stream or sys.stderr
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.off = mode == "off"  # ranks other than the first stay quiet
        self.bar = mode == "bar" or (mode == "auto" and is_tty)
        self.total, self.start, self.width = total, start, width
        self.every = max(1, (total - start) // 20)
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self.val_loss: float | None = None

    def update(self, step: int, loss: float, tokens_per_s: float, val_loss: float | None = None) -> None:
        if self.off:
            return
        if val_loss is not None:
            self.val_loss = val_loss
        done = step - self.start
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / max(done, 1) * (self.total - step)
        val = f" val {self.val_loss:.3f}" if self.val_loss is not None else ""
        text = (f"step {step}/{self.total} loss {loss:.3f}{val} {_si(tokens_per_s)} tok/s "
                f"{format_duration(elapsed)}<{format_duration(eta)}")
        if self.bar:
            now = time.perf_counter()
            if now - self._last_draw < 0.1 and step < self.total and val_loss is None:
                return
            self._last_draw = now
            filled = int(self.width * step / max(self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {text}\033[K")
            self.stream.flush()
        elif val_loss is not None or step % self.every == 0 or step == self.total:
            self.stream.write(text + "\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        """A line that does not disturb the bar."""
        self.stream.write(("\r\033[K" if self.bar else "") + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.bar and not self.off:
            self.stream.write("\n")
            self.stream.flush()
