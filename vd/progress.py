"""How a long operation reports progress to whoever shows it (`Progress`): a phase at a time, and steps
within a phase. The command line shows them; a library caller may pass nothing (`SILENT`)."""

from __future__ import annotations

from typing import Protocol


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
