"""A dependency-free progress bar for the bench (stderr).

On a terminal it redraws one line; elsewhere (CI logs, notebooks) it prints a line when
a run starts and finishes, and at most every ``every_s`` seconds in between. The
estimate of the time left counts a run's first step (its compilation) apart from the
steady steps, so the compilation of the first run does not inflate it.
"""

from __future__ import annotations

import statistics
import sys
import time


def _clock(s: float) -> str:
    s = int(max(0, s))
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


class Progress:
    """Counts steps across all runs of the bench and shows done / total, elapsed and an
    estimate of the time left.

    Args:
      total_steps: steps of every run together.
      total_runs: runs together (each has a first step that compiles).
      stream: where to write (stderr).
      every_s: seconds between lines when not on a terminal.

    >>> import io
    >>> p = Progress(total_steps=4, total_runs=2, stream=io.StringIO())
    >>> p.start_run("a")
    >>> p.step(); p.step()
    >>> p.done, p.runs_started
    (2, 1)
    """

    def __init__(self, total_steps: int, total_runs: int = 1, stream=None, width: int = 24,
                 every_s: float = 30.0):
        self.total = max(1, total_steps)
        self.total_runs = max(1, total_runs)
        self.done = 0
        self.runs_started = 0
        self.stream = stream or sys.stderr
        self.width = width
        self.every_s = every_s
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._last_step = self.t0
        self._first = False
        self._compiles: list[float] = []  # first step of each run (compiles)
        self._steps: list[float] = []  # the other steps
        self.label = ""

    def eta(self) -> float | None:
        """Seconds left: the steady steps at their median time, plus the first step of
        each run not yet started at the mean first-step time; None before any step."""
        if not self._compiles:
            return None
        step = statistics.median(self._steps) if self._steps else self._compiles[-1]
        runs_left = self.total_runs - self.runs_started
        steady_left = (self.total - self.done) - runs_left
        return max(0.0, steady_left * step + runs_left * statistics.mean(self._compiles))

    def line(self) -> str:
        frac = self.done / self.total
        fill = int(frac * self.width)
        elapsed = time.perf_counter() - self.t0
        eta = self.eta()
        left = f"~{_clock(eta)} left" if eta is not None else "compiling"
        return (f"[{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:5.1f}%  "
                f"{_clock(elapsed)} elapsed, {left}  {self.label}")

    def start_run(self, label: str) -> None:
        """A run begins: its first step compiles."""
        self.label = label
        self.runs_started += 1
        self._first = True
        self._last_step = time.perf_counter()
        if self.tty:
            self._draw()
        else:
            self.note(f"{label}: compiling ({self.line()})")

    def step(self, n: int = 1) -> None:
        now = time.perf_counter()
        (self._compiles if self._first else self._steps).append((now - self._last_step) / n)
        self._first = False
        self._last_step = now
        self.done += n
        if self.tty and now - self._last > 0.2:
            self._draw()
        elif not self.tty and now - self._last > self.every_s:
            self.note(self.line())

    def _draw(self) -> None:
        self.stream.write("\r" + self.line()[:150].ljust(150))
        self.stream.flush()
        self._last = time.perf_counter()

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
