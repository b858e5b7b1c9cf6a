"""How a long operation reports progress to whoever shows it (`Progress`): a phase at a time, and steps
within a phase. The command line shows them as a bar on a terminal and as plain lines (`Lines`) in a log;
a library caller may pass nothing (`SILENT`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TextIO


class Progress(Protocol):
    def phase(self, name: str, total: int) -> None:
        """A phase begins, of ``total`` steps (0: not counted)."""

    def step(self, s: int) -> None:
        """Step ``s`` of the current phase is done."""


class _Silent:
    def phase(self, name: str, total: int) -> None:
        pass

    def step(self, s: int) -> None:
        pass


SILENT: Progress = _Silent()


class Lines:
    """Progress as plain lines for a log or a CI job: one when a phase begins, one when it ends with its
    count of steps and its seconds (``vd: K=2 eager: 16/16 steps in 3.1 s``), and in a long phase a count every
    `INTERIM_S` seconds (``vd: greedy continuation: 40/65 steps, 31 s``), so a log never sits silent for
    minutes. No carriage returns and no terminal codes, each line flushed as written. A phase ends when the
    next begins or at `end`."""

    INTERIM_S = 30.0

    def __init__(self, stream: TextIO, prefix: str = "vd: ", clock: Callable[[], float] = time.perf_counter):
        self.stream, self.prefix, self.clock = stream, prefix, clock
        self.name: str | None = None
        self.total = self.done = 0
        self.started = self.said = 0.0

    def phase(self, name: str, total: int) -> None:
        self.end()
        self.name, self.total, self.done, self.started = name, total, 0, self.clock()
        self.said = self.started
        self._line(f"{name} ({total} steps)" if total else name)

    def step(self, s: int) -> None:
        self.done += 1
        now = self.clock()
        if now - self.said >= self.INTERIM_S and self.done < self.total:
            self.said = now
            self._line(f"{self.name}: {self.done}/{self.total} steps, {now - self.started:.0f} s")

    def end(self, failed: bool = False) -> None:
        """The current phase is over: its closing line (nothing when no phase is open); ``failed``: it ended in
        an error (a suite's golden that could not be loaded or run), said so rather than done."""
        if self.name is None:
            return
        seconds = self.clock() - self.started
        count = f"{self.done}/{self.total} steps" if self.total else "done"
        if failed:
            self._line(f"{self.name}: failed" + (f" at {count}" if self.total else "") + f" after {seconds:.1f} s")
        else:
            self._line(f"{self.name}: {count} in {seconds:.1f} s")
        self.name = None

    def _line(self, text: str) -> None:
        self.stream.write(f"{self.prefix}{text}\n")
        self.stream.flush()
