"""A dependency-free progress bar for the bench (stderr).

On a terminal it redraws one line; elsewhere (CI logs, notebooks) it prints a line when
a run finishes and at most every ``every_s`` seconds in between.
"""

from __future__ import annotations

import sys
import time


def _clock(s: float) -> str:
    s = int(max(0, s))
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


class Progress:
    """Counts steps across all runs of the bench and shows done / total, elapsed and ETA."""

    def __init__(self, total_steps: int, stream=None, width: int = 24, every_s: float = 30.0):
        self.total = max(1, total_steps)
        self.done = 0
        self.stream = stream or sys.stderr
        self.width = width
        self.every_s = every_s
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._last = 0.0
        self.label = ""

    def line(self) -> str:
        frac = self.done / self.total
        fill = int(frac * self.width)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        eta_s = _clock(eta) if frac > 0 else "?"
        return (f"[{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:5.1f}%  "
                f"{_clock(elapsed)} elapsed, ~{eta_s} left  {self.label}")

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.tty and now - self._last > 0.2:
            self.stream.write("\r" + self.line()[:150].ljust(150))
            self.stream.flush()
            self._last = now
        elif not self.tty and now - self._last > self.every_s:
            self.note(self.line())

    def note(self, text: str) -> None:
        """A message on its own line (the bar is redrawn after it on a terminal)."""
        self._last = time.perf_counter()
        if self.tty:
            self.stream.write("\r" + " " * 150 + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
