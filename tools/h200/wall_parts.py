"""Functions timed by wall clock where they stand, no profiler (`tools/h200/replay_parts.py`, `tail_parts.py`,
`writer_timeline.py`, `step_host.py`): `wrap` replaces one with a twin adding its seconds to ``ACC[label]`` and its
calls to ``COUNT[label]``; `stamp` with one appending each call's (label, start, end) to a list."""

from __future__ import annotations

import collections
import functools
import time

ACC: dict[str, float] = collections.defaultdict(float)
COUNT: dict[str, int] = collections.defaultdict(int)


def _timed(owner, name: str, done) -> None:
    """``owner.name`` replaced by a twin that calls ``done(start, end)`` (`time.perf_counter`) after each call."""
    orig = getattr(owner, name)

    @functools.wraps(orig)
    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return orig(*a, **kw)
        finally:
            done(t, time.perf_counter())

    setattr(owner, name, timed)


def wrap(owner, name: str, label: str) -> None:
    """``owner.name`` timed under ``label`` (a part's time includes what it calls)."""

    def add(start: float, end: float) -> None:
        ACC[label] += end - start
        COUNT[label] += 1

    _timed(owner, name, add)


def stamp(owner, name: str, label: str, into: list[tuple[str, float, float]]) -> None:
    """``owner.name``'s calls appended to ``into`` as (``label``, start, end), by `time.perf_counter`."""
    _timed(owner, name, lambda start, end: into.append((label, start, end)))
